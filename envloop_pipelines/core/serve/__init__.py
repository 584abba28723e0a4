"""Serving a release: the Jev API and an OpenAI-compatible chat over one checkpoint (``docs/jev-api.md``).

Modules, bottom up: ``settings`` (what a server is started with), ``schemas``
(requests, validation, question → model input), ``answers`` (probabilities →
Jev answers), ``inference`` (one batch → one ``predict`` call, option windows),
``lifecycle`` (load on demand, unload when idle), ``batcher`` (micro-batching,
load shedding), ``prometheus`` (metrics), ``app`` (``create_app``: routes, auth,
errors) and ``server`` (``run``: uvicorn with graceful shutdown). The CLI is
``envloop serve`` (:mod:`envloop_pipelines.cli.serve`).
"""

from envloop_pipelines.core.serve.settings import MODEL_ALIASES, ServeSettings

__all__ = ["MODEL_ALIASES", "ServeSettings"]
