"""A bounded soak test on 127.0.0.1: greedy streaming and non-streaming requests, client disconnects, oversized
and hostile bodies, all in parallel. Afterwards no 5xx was seen, the pool holds zero blocks, and every greedy
output equals the same request run alone."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from live_server import make_engine, running, wait_for

from kvtrim.serve.http import create_app
from kvtrim.serve.limits import ServerLimits

LIMITS = ServerLimits(max_request_bytes=16 * 1024, max_tokens=64, max_prompt_chars=4000)
GREEDY = 24
JSON = {"content-type": "application/json"}


def _greedy_body(i: int) -> tuple[str, dict]:
    stream = i % 2 == 0
    if i % 3 == 0:
        body = {"messages": [{"role": "user", "content": f"question {i}: " + "ab" * i}], "max_tokens": 12 + i % 7}
        return "/v1/chat/completions", {**body, "temperature": 0, "ignore_eos": True, "stream": stream}
    body = {"prompt": f"prompt {i} " + "xy" * (3 * i), "max_tokens": 10 + i % 9, "temperature": 0}
    return "/v1/completions", {**body, "ignore_eos": True, "stream": stream}


def _text(path: str, r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    payloads = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    out = ""
    for p in payloads[:-1]:
        choice = json.loads(p)["choices"][0]
        out += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
    return out


def _greedy(url: str, i: int) -> str:
    path, body = _greedy_body(i)
    with httpx.Client(base_url=url, timeout=60) as http:
        return _text(path, http.post(path, json=body), body["stream"])


def _disconnect(url: str, i: int) -> int:
    body = {"prompt": f"leave {i}", "max_tokens": 60, "ignore_eos": True, "stream": i % 2 == 0}
    if body["stream"]:
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())  # read a little, then drop the connection
            return r.status_code
    with httpx.Client(base_url=url, timeout=0.05) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)
    return 0


HOSTILE: list[tuple[str, bytes, dict]] = [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', JSON),
    ("/v1/completions", b"[" * 20_000 + b"]" * 20_000, JSON),
    ("/v1/completions", b"{oops", JSON),
    ("/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}),
    ("/v1/completions", b'{"prompt": "x"}', {**JSON, "host": "evil.example"}),
    ("/v1/completions", b'{"prompt": "x"}', {**JSON, "origin": "http://evil.example"}),
    ("/v1/completions", b'{"prompt": ["a"], "max_tokens": 100000}', JSON),
    ("/v1/completions", b'{"prompt": "' + b"z" * 5000 + b'"}', JSON),
]


def _hostile(url: str, i: int) -> int:
    path, raw, headers = HOSTILE[i % len(HOSTILE)]
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post(path, content=raw, headers=headers).status_code


def _oversized(url: str, i: int) -> int:
    raw = json.dumps({"prompt": "q" * (20_000 + i)}).encode()
    with httpx.Client(base_url=url, timeout=60) as http:
        if i % 2:  # streamed without Content-Length
            r = http.post(
                "/v1/completions", content=(raw[k : k + 4096] for k in range(0, len(raw), 4096)), headers=JSON
            )
        else:
            r = http.post("/v1/completions", content=raw, headers=JSON)
        return r.status_code


def test_soak():
    torch.set_num_threads(1)
    engine = make_engine(kv_blocks=4096)
    t0 = time.monotonic()
    with running(create_app(engine, limits=LIMITS)) as url:
        jobs = [(_greedy, i) for i in range(GREEDY)] + [(_disconnect, i) for i in range(8)]
        jobs += [(_hostile, i) for i in range(2 * len(HOSTILE))] + [(_oversized, i) for i in range(6)]
        random.Random(0).shuffle(jobs)
        with ThreadPoolExecutor(max_workers=12) as pool:
            futures = [(fn, i, pool.submit(fn, url, i)) for fn, i in jobs]
            results = [(fn, i, f.result(timeout=120)) for fn, i, f in futures]
        soak_s = time.monotonic() - t0
        statuses = [r for fn, _, r in results if fn in (_hostile, _oversized, _disconnect)]
        assert all(s < 500 for s in statuses), statuses
        assert all(r == 413 for fn, _, r in results if fn is _oversized)
        assert all(400 <= r < 500 for fn, _, r in results if fn is _hostile)
        wait_for(lambda: engine.pool.num_used == 0 and not engine.has_work(), timeout=20)
        with httpx.Client(base_url=url, timeout=60) as http:
            metrics = http.get("/metrics").text
        assert 'status="500"' not in metrics
        concurrent = {i: text for fn, i, text in results if fn is _greedy}
        solo = {i: _greedy(url, i) for i in range(GREEDY)}  # one at a time
    assert engine.pool.num_used == 0
    assert concurrent == solo
    assert all(solo.values())
    assert soak_s < 60, soak_s
