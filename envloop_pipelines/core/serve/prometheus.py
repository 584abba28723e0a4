"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

A registry per app (not the process-global one) keeps two apps in one
process, as in tests, from colliding. Names carry the ``envloop_serve_`` prefix.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """The server's counters, gauges and histograms."""

    def __init__(self, model_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("envloop_serve_model_info", "The served model (value 1).", ["model"], registry=r)
        self.info.labels(model=model_id).set(1)
        self.requests = Counter("envloop_serve_requests", "HTTP requests by route and status.", ["route", "status"], registry=r)
        self.latency = Histogram(
            "envloop_serve_request_seconds", "Request latency by route.", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.questions = Counter("envloop_serve_questions", "Questions answered.", ["type"], registry=r)
        self.shed = Counter("envloop_serve_shed", "Requests refused to shed load, by status (429 per key, 529 queue full).", ["status"], registry=r)
        self.batch_questions = Histogram(
            "envloop_serve_batch_questions", "Questions per gathered batch.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "envloop_serve_batch_requests", "Requests per gathered batch.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "envloop_serve_batch_seconds", "Seconds in the model per batch.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "envloop_serve_queue_wait_seconds", "Wait of a batch's oldest request before its batch ran.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queued = Gauge("envloop_serve_queued_questions", "Questions waiting for the model.", registry=r)
        self.loaded = Gauge("envloop_serve_model_loaded", "1 while the model is in memory, 0 when scaled to zero.", registry=r)
        self.cold_start = Histogram(
            "envloop_serve_cold_start_seconds", "Model load time at each cold start.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.unloads = Counter("envloop_serve_unloads", "Times the model was unloaded after going idle.", registry=r)
        self.input_tokens = Counter("envloop_serve_input_tokens", "Input tokens of answered requests.", registry=r)

    def on_batch(self, questions: int, requests: int, seconds: float, oldest_wait: float) -> None:
        self.batch_questions.observe(questions)
        self.batch_requests.observe(requests)
        self.batch_seconds.observe(seconds)
        self.queue_wait.observe(oldest_wait)

    def on_load(self, seconds: float) -> None:
        self.cold_start.observe(seconds)
        self.loaded.set(1)

    def on_unload(self) -> None:
        self.unloads.inc()
        self.loaded.set(0)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics"]
