"""``envloop env``: environment datasets (list, show, Harbor export and import) and agent evaluation."""

from __future__ import annotations

import click


@click.group()
def env() -> None:
    """Environment datasets: executable, replayable environments, Harbor folders and agent evaluation."""
