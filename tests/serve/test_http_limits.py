"""Request limits (kvtrim.serve.limits): body size enforced while reading, prompt/max_tokens caps before
tokenizing, JSON depth, lone surrogates; every rejection a 4xx that names the limit, keep-alive intact."""

from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import pytest
import torch
from live_server import make_engine, running

from kvtrim.errors import InvalidParameterError
from kvtrim.serve.http import create_app
from kvtrim.serve.limits import ServerLimits, json_depth, parse_json
from kvtrim.serve.openai_schema import RequestError

SMALL = ServerLimits(
    max_request_bytes=4096, max_prompts_per_request=2, max_tokens=8, max_prompt_chars=200, max_json_depth=8
)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    engine = make_engine()
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def small_url(engine):
    with running(create_app(engine, manage_engine=False, limits=SMALL)) as url:
        yield url


@pytest.fixture(scope="module")
def default_url(engine):
    with running(create_app(engine, manage_engine=False)) as url:
        yield url


def _error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def _raw_post(url: str, head: bytes, chunks: list[bytes]) -> bytes:
    """Send a hand-made request on a raw socket; returns what the server answered (up to 64 KiB)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: what it said is still readable
        data = b""
        try:
            while len(data) < 65536 and (part := sock.recv(65536)):
                data += part
        except (ConnectionResetError, TimeoutError):
            pass
        return data


# -------------------------------------------------------------------------------------------------- body size
def test_declared_content_length_over_the_limit_is_refused_unread(small_url):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5000000\r\n\r\n"
    )
    t0 = time.monotonic()
    answer = _raw_post(small_url, head, [])  # no body sent at all: the answer cannot depend on reading it
    assert time.monotonic() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and "--max-request-bytes" in body["error"]["message"]
    assert "5000000" in body["error"]["message"] and "4096" in body["error"]["message"]


def test_chunked_body_over_the_limit_is_refused_while_reading(small_url):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 1024
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(2000)]  # 2 MB, never terminated
    answer = _raw_post(small_url, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_httpx_oversized_bodies(small_url):
    with httpx.Client(base_url=small_url) as http:
        message = _error(http.post("/v1/completions", json={"prompt": "x" * 5000}), 413, "request_too_large")
        assert "--max-request-bytes" in message
        stream = (b"{" + b" " * 1000 for _ in range(10))  # no Content-Length: chunked upload
        r = http.post("/v1/completions", content=stream, headers={"content-type": "application/json"})
        _error(r, 413, "request_too_large")
        assert http.get("/health").status_code == 200


def test_malformed_content_length(small_url):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: -3\r\n\r\n"
    )
    answer = _raw_post(small_url, head, [])
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


# ------------------------------------------------------------------------------------------- request caps
def test_prompt_and_token_caps(small_url):
    with httpx.Client(base_url=small_url) as http:
        post = lambda body: http.post("/v1/completions", json={"max_tokens": 2, **body})  # noqa: E731
        msg = _error(post({"prompt": ["a", "b", "c"]}), 400, "too_many_prompts", "prompt")
        assert "--max-prompts-per-request" in msg and "2" in msg
        msg = _error(post({"prompt": "x" * 201}), 400, "prompt_too_long", "prompt")
        assert "201 characters" in msg and "--max-prompt-chars" in msg
        _error(post({"prompt": [[5] * 201]}), 400, "prompt_too_long", "prompt")
        msg = _error(post({"prompt": "x", "max_tokens": 9}), 400, "max_tokens_exceeded", "max_tokens")
        assert "--max-tokens" in msg and "8" in msg
        assert post({"prompt": ["a", "b"], "max_tokens": 8}).status_code == 200
        chat = lambda body: http.post("/v1/chat/completions", json=body)  # noqa: E731
        msgs = [{"role": "user", "content": "y" * 150}, {"role": "user", "content": "z" * 60}]
        _error(chat({"messages": msgs}), 400, "prompt_too_long", "messages")
        one = [{"role": "user", "content": "hi"}]
        _error(chat({"messages": one, "max_completion_tokens": 9}), 400, "max_tokens_exceeded", "max_completion_tokens")
        # without max_tokens a chat reply is capped by --max-tokens too
        r = chat({"messages": one, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------------------------------ hostile JSON
def test_deep_json_is_a_400(small_url, default_url):
    with httpx.Client(base_url=default_url) as http:
        deep = b"[" * 100_000 + b"]" * 100_000
        r = http.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        msg = _error(r, 400, "json_too_deep")
        assert "100000" in msg
        nested = {"prompt": "x", "max_tokens": 2, "user": json.loads("[" * 31 + "]" * 31)}
        assert http.post("/v1/completions", json=nested).status_code == 200
    with httpx.Client(base_url=small_url) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "user": [[[[[[[[1]]]]]]]]})
        _error(r, 400, "json_too_deep")


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ],
)
def test_lone_surrogates_are_a_400(default_url, path, raw):
    with httpx.Client(base_url=default_url) as http:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert "surrogate" in _error(r, 400, "invalid_unicode")


def test_surrogate_pairs_are_fine(default_url):
    with httpx.Client(base_url=default_url) as http:
        raw = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
        assert (
            http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}).status_code == 200
        )


def test_keep_alive_survives_errors(default_url):
    """After a 500 the keep-alive connection was reset on the next request in 3 of 8 tries."""
    host, port = default_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"content-type": "application/json"}
    bad_bodies = [b'{"prompt": "\\ud800"}', b"[" * 50_000 + b"]" * 50_000, b"{nope", b'{"prompt": 3}']
    try:
        for i in range(8):
            conn.request("POST", "/v1/completions", body=bad_bodies[i % len(bad_bodies)], headers=headers)
            bad = conn.getresponse()
            assert bad.status == 400 and b"error" in bad.read()
            sock = conn.sock
            conn.request("POST", "/v1/completions", body=b'{"prompt": "ok", "max_tokens": 2}', headers=headers)
            good = conn.getresponse()
            assert good.status == 200 and json.loads(good.read())["choices"]
            assert conn.sock is sock, "the connection was re-opened"
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------ units
def test_json_depth():
    assert json_depth(b"{}") == 1 and json_depth(b"1") == 0
    assert json_depth(b'{"a": [1, {"b": [2]}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[[[", "b": [[]]}') == 3
    assert json_depth(b"[" * 1000 + b"]" * 1000) == 1000


def test_parse_json():
    assert parse_json(b'{"a": "\\ud83d\\ude00"}', 4) == {"a": "\U0001f600"}
    with pytest.raises(RequestError, match="nests JSON 5 levels"):
        parse_json(b"[[[[[1]]]]]", 4)
    with pytest.raises(RequestError, match="surrogate"):
        parse_json(b'["\\ud800"]', 4)
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b"\xff\xfe", 4)
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b'{"a": 1' + b"9" * 5000 + b"}", 4)  # an int beyond Python's digit limit


def test_tiny_temperatures_are_greedy(default_url):
    """Found by the fuzz test: temperature 1e-300 overflowed the logits to NaN probabilities (a 500)."""
    with httpx.Client(base_url=default_url) as http:
        outs = [
            http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": t})
            for t in (5e-324, 1e-300, 0)
        ]
        assert [r.status_code for r in outs] == [200, 200, 200]
        assert len({r.json()["choices"][0]["text"] for r in outs}) == 1


def test_limits_validation():
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        ServerLimits(max_tokens=0)
    with pytest.raises(InvalidParameterError, match="max_request_bytes"):
        ServerLimits(max_request_bytes=True)
    with pytest.raises(InvalidParameterError, match="max_json_depth"):
        ServerLimits(max_json_depth=1)
