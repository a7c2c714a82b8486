"""Fuzzed request bodies against a live server: never a 5xx, and a healthy server (no leaked blocks) afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import make_engine, running, wait_for

from kvtrim.serve.http import create_app
from kvtrim.serve.limits import ServerLimits

LIMITS = ServerLimits(max_request_bytes=64 * 1024, max_tokens=12, max_prompt_chars=2000)

# Text with lone surrogates and control characters (json.dumps writes them as \\uXXXX escapes).
surrogate_text = st.lists(st.characters(categories=["Cs"]) | st.characters(), min_size=1, max_size=8).map("".join)
any_text = st.text(max_size=40) | surrogate_text  # st.text itself never yields surrogates
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | any_text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=12
)
KEYS = (
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
    "stream_options", "ignore_eos", "n", "model", "logit_bias", "response_format", "user", "echo", "logprobs",
)  # fmt: skip
content = any_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}), max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": content}
)
# Mostly valid bodies (so that inputs get past the field checks to the tokenizer and the engine) ...
sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stop": any_text | st.lists(any_text, min_size=1, max_size=4),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
}
prompt = any_text | st.lists(st.integers(0, 258), min_size=1, max_size=8) | st.lists(any_text, min_size=1, max_size=3)
completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": st.integers(1, 12)}, optional=sampling)
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={"max_tokens": st.integers(1, 12), **sampling},
)
# ... with up to two fields replaced by anything at all.
mutations = st.dictionaries(st.sampled_from(KEYS) | any_text, json_values, max_size=2)


def _mutated(valid):
    return st.builds(lambda base, mutation: json.dumps({**base, **mutation}).encode(), valid, mutations)


hostile = (
    json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
    | st.integers(1, 5000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}")
)
cases = st.one_of(
    st.tuples(st.just("/v1/completions"), _mutated(completion) | hostile),
    st.tuples(st.just("/v1/chat/completions"), _mutated(chat) | hostile),
)


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    engine = make_engine()
    with running(create_app(engine, limits=LIMITS)) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield engine, http


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and "server_error" not in r.text, r.text
    else:
        assert r.json()["choices"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_fuzzed_bodies_never_5xx(served, case):
    _, http = served
    path, raw = case
    _check(http.post(path, content=raw, headers={"content-type": "application/json"}))


def test_server_is_healthy_after_fuzzing(served):
    engine, http = served
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_for(lambda: engine.pool.num_used == 0)
