"""Prometheus metrics of the server (``GET /metrics``, text exposition format, via ``prometheus-client``).

Engine gauges and counters are read from :attr:`Engine.stats` at scrape time (no bookkeeping on the decode
path); HTTP responses are counted by endpoint and status code by :class:`RequestCounterMiddleware`. Names follow
vLLM's where a counterpart exists, under the ``kvtrim_`` prefix; counters end in ``_total`` so that tokens per
second is ``rate(kvtrim_generation_tokens_total[1m])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Known paths get their own label; anything else is "other", so hostile traffic cannot grow the label set.
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

_GAUGES = (
    ("num_requests_running", "requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "requests_waiting", "Requests queued for admission (preempted ones included)."),
    ("kv_blocks_used", "pool_blocks_used", "KV pool blocks in use."),
    ("kv_blocks_free", "pool_blocks_free", "KV pool blocks free."),
    ("kv_blocks_total", "pool_blocks_total", "KV pool blocks in all."),
)
_COUNTERS = (
    ("num_preemptions", "preemptions", "Preemptions (by recompute) since start."),
    ("compressions", "compressions", "Sequence compressions that evicted at least one block."),
    ("blocks_evicted", "blocks_evicted", "KV blocks freed by compression."),
    ("generation_tokens", "tokens_generated", "Tokens generated."),
    ("prefill_tokens", "prefill_tokens", "Tokens fed by prefills (recomputes after preemption included)."),
    ("requests_finished", "requests_finished", "Requests finished in the engine (any reason)."),
)


class EngineCollector(Collector):
    """Engine counters as Prometheus metrics, read from ``stats()`` (an :class:`EngineStats`) on every scrape."""

    def __init__(self, stats: Callable[[], object]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, field, doc in _GAUGES:
            yield GaugeMetricFamily(f"kvtrim_{name}", doc, value=getattr(s, field))
        total = s.pool_blocks_total
        usage = s.pool_blocks_used / total if total else 0.0
        yield GaugeMetricFamily("kvtrim_kv_cache_usage_ratio", "Fraction of KV pool blocks in use (0-1).", usage)
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(f"kvtrim_{name}", doc, value=getattr(s, field))


class Metrics:
    """One registry per app (several apps may live in one process, as in the tests)."""

    def __init__(self, stats: Callable[[], object]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(stats))
        self.http_requests = Counter(
            "kvtrim_http_requests",
            "HTTP responses by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class RequestCounterMiddleware:
    """Counts every HTTP response (rejections by the other middlewares included) by endpoint and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
