"""The server's Prometheus metrics (``GET /metrics``), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process).

    Attributes:
        requests: HTTP requests by route template and status.
        tokens: tokens by kind: ``prompt`` (in context), ``completion`` (generated), ``memory`` (written).
        sessions: sessions the store holds in RAM.
        queued: jobs waiting for the worker.
        batch_size: jobs per batch the worker ran, by job kind.
        latency: seconds from request to response (to the stream's start for streams), by route.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lstmem_requests", "HTTP requests", ["route", "status"], registry=self.registry
        )
        self.tokens = Counter(
            "lstmem_tokens",
            "tokens: prompt (in context), completion, memory (written)",
            ["kind"],
            registry=self.registry,
        )
        self.sessions = Gauge("lstmem_sessions", "sessions in the store's memory", registry=self.registry)
        self.queued = Gauge("lstmem_queued_jobs", "jobs waiting for the worker", registry=self.registry)
        self.batch_size = Histogram(
            "lstmem_batch_size",
            "jobs per batch",
            ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.latency = Histogram(
            "lstmem_request_seconds",
            "request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )

    def count_result(self, result: dict) -> None:
        """Count the tokens of one finished turn or score (a scheduler ``done`` result)."""
        self.tokens.labels(kind="prompt").inc(result["prompt_tokens"])
        self.tokens.labels(kind="completion").inc(sum(len(a.token_ids) for a in result["choices"]))
        self.tokens.labels(kind="memory").inc(result["written"])
