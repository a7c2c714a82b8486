"""GET /metrics: Prometheus text from the engine's stats and the HTTP response counter."""

from __future__ import annotations

import httpx
import pytest
import torch
from live_server import make_engine, running
from prometheus_client.parser import text_string_to_metric_families

from kvtrim.serve.http import create_app
from kvtrim.serve.limits import ServerLimits


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    engine = make_engine(kv_blocks=384)
    with running(create_app(engine, limits=ServerLimits(max_request_bytes=2048))) as url:
        yield engine, url


def _scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics(served):
    engine, url = served
    with httpx.Client(base_url=url) as http:
        before = _scrape(http)
        for name in (
            "kvtrim_num_requests_running",
            "kvtrim_num_requests_waiting",
            "kvtrim_kv_blocks_used",
            "kvtrim_kv_blocks_free",
            "kvtrim_kv_cache_usage_ratio",
            "kvtrim_num_preemptions_total",
            "kvtrim_compressions_total",
            "kvtrim_generation_tokens_total",
            "kvtrim_prefill_tokens_total",
        ):
            assert (name, ()) in before, name
        assert before["kvtrim_kv_blocks_total", ()] == 384
        assert before["kvtrim_kv_blocks_free", ()] + before["kvtrim_kv_blocks_used", ()] == 384
        body = {"prompt": "count me", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x" * 3000}).status_code == 413
        assert http.post("/v1/completions", json={"prompt": 3}).status_code == 400
        assert http.get("/no/such/path").status_code == 404
        after = _scrape(http)
    tokens = after["kvtrim_generation_tokens_total", ()] - before["kvtrim_generation_tokens_total", ()]
    assert tokens == 5
    assert after["kvtrim_requests_finished_total", ()] - before["kvtrim_requests_finished_total", ()] == 1
    assert after["kvtrim_kv_blocks_used", ()] == engine.pool.num_used == 0
    assert after["kvtrim_num_requests_running", ()] == 0

    def count(endpoint: str, status: str) -> float:
        key = ("kvtrim_http_requests_total", (("endpoint", endpoint), ("status", status)))
        return after.get(key, 0) - before.get(key, 0)

    assert count("/v1/completions", "200") == 1
    assert count("/v1/completions", "413") == 1
    assert count("/v1/completions", "400") == 1
    assert count("other", "404") == 1
    assert count("/metrics", "200") == 1  # the first scrape
