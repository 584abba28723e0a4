"""``python -m envloop_pipelines.cli``: the ``envloop`` command (what ``accelerate launch -m`` runs)."""

from envloop_pipelines.cli import main

main()
