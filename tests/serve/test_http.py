"""The OpenAI-compatible server: a real uvicorn server over a real Engine (tiny random-weight Llama), hit with
httpx and with the official ``openai`` client."""

from __future__ import annotations

import gc
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from conftest import byte_tokenizer, tiny_model
from kvtrim.serve.http import create_app
from kvtrim.serve.openai_schema import RequestError, parse_chat, parse_completion
from kvtrim.serve.types import RequestHandle, TokenEvent

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LONG = 1500  # max_tokens of requests that are cancelled before they finish


class RecordingEngine:
    """The real engine, with submitted handles and cancel calls recorded."""

    def __init__(self, engine):
        self._engine = engine
        self.handles: dict[str, RequestHandle] = {}
        self.cancelled: list[str] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, prompt, params=None, request_id=None, chat=False):
        handle = self._engine.submit(prompt, params, request_id=request_id, chat=chat)
        self.handles[handle.request_id] = handle
        return handle

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return self._engine.cancel(request_id)


def _make_engine():
    from kvtrim.serve.engine import Engine

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return Engine(tiny_model("llama"), tokenizer, kv_blocks=512, block_size=16, seed=0)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return RecordingEngine(_make_engine())


@pytest.fixture(scope="module")
def base_url(engine):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)
    sock.close()


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def _sse_payloads(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response (JSON-decoded, except the final ``[DONE]``)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------- basic endpoints
def test_health_and_models(http, client, engine, model):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [engine.model_name]
    assert [m.id for m in client.models.list()] == [model]


def test_unknown_route_is_an_openai_error(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------------------------ completions
def test_completion_httpx(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == model
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["prompt_tokens"] >= len("hello world")
    assert 1 <= usage["completion_tokens"] <= 5 or choice["finish_reason"] == "stop"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_openai_client_is_greedy_deterministic(client, http, model):
    args = {"model": model, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
    first = client.completions.create(**args)
    second = http.post("/v1/completions", json=args).json()
    assert first.choices[0].text == second["choices"][0]["text"]
    assert first.usage.completion_tokens == second["usage"]["completion_tokens"]


def test_completion_token_id_prompt(client, model, engine):
    ids = engine.tokenizer("abc", add_special_tokens=False)["input_ids"]
    out = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == len(ids)


def test_completion_several_prompts(http, model):
    prompts = ["first prompt", "second, longer prompt"]
    body = {"model": model, "prompt": prompts, "max_tokens": 4, "temperature": 0}
    batched = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in batched["choices"]] == [0, 1]
    alone = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts]
    assert [c["text"] for c in batched["choices"]] == alone
    streamed = _sse_payloads(http.post("/v1/completions", json={**body, "stream": True}))
    texts = ["", ""]
    for chunk in streamed[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == alone and streamed[-1] == "[DONE]"


def test_completion_stream_matches_non_stream(client, http, model):
    args = {"model": model, "prompt": "streaming test", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    raw = _sse_payloads(
        http.post("/v1/completions", json={**args, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert raw[-1] == "[DONE]" and raw[-2]["choices"] == []
    assert raw[-2]["usage"]["completion_tokens"] == full.usage.completion_tokens


def _stop_case(http, model, prompt: str) -> tuple[str, str] | None:
    """A stop string taken from the middle of a greedy completion (printable ASCII), with the expected cut."""
    text = http.post(
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 30, "temperature": 0}
    ).json()["choices"][0]["text"]
    for start in range(3, len(text) - 2):
        stop = text[start : start + 2]
        if stop.isascii() and stop.isprintable():
            return stop, text[: text.find(stop)]
    return None


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings(http, client, model, as_list):
    for prompt in ("stop test", "another stop test", "a third prompt"):
        if case := _stop_case(http, model, prompt):
            break
    else:
        pytest.skip("no printable stop string in the random model's output")
    stop, expected = case
    args = {"model": model, "prompt": prompt, "max_tokens": 30, "temperature": 0}
    args["stop"] = [stop, "\x00never"] if as_list else stop
    out = client.completions.create(**args)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_with_seed_is_reproducible(client, model):
    args = {"model": model, "prompt": "sample me", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 123}
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


# ----------------------------------------------------------------------------------------------------- chat
def test_chat_openai_client(client, model, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(engine.tokenizer(ids, add_special_tokens=False)["input_ids"])
    same = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6, temperature=0)
    assert same.choices[0].message.content == out.choices[0].message.content


def test_chat_stream(client, http, model):
    args = {
        "model": model,
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    raw = _sse_payloads(http.post("/v1/chat/completions", json={**args, "stream": True}))
    assert raw[-1] == "[DONE]" and raw[-2]["choices"][0]["delta"] == {}


def test_chat_without_template_uses_a_transcript(http, model, engine, monkeypatch):
    # Engine.encode renders with per-thread copies of the engine's tokenizer: drop the copies made so far
    inner = engine._engine
    monkeypatch.setattr(inner._pristine_tok, "chat_template", None)
    monkeypatch.setattr(inner, "_thread_tok", threading.local())
    body = {"model": model, "messages": [{"role": "user", "content": "xyz"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    monkeypatch.undo()
    inner._thread_tok = threading.local()  # later tests render with the template again
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("user: xyz\nassistant:")


# ---------------------------------------------------------------------------------------------------- errors
BAD_COMPLETIONS = [
    ({"n": 2}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"seed": -1}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"echo": True}, "echo"),
    ({"logprobs": 2}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
]


@pytest.mark.parametrize(("update", "param"), BAD_COMPLETIONS)
def test_completion_bad_parameters(http, model, update, param):
    r = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, **update})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("update", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"n": 3}, "n"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_chat_bad_parameters(http, model, update, param):
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], **update}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_bodies(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400
    assert http.post("/v1/completions", json={"max_tokens": 3}).json()["error"]["param"] == "prompt"


def test_openai_client_errors(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_engine_rejection_is_400(http, client, model):
    """prompt + max_tokens beyond the model's positions: the engine rejects at submit."""
    r = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 5000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5000)


# ---------------------------------------------------------------------------------------------- cancellation
def _long_request_args(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_closing_a_stream_cancels_the_request(client, engine, model):
    stream = client.completions.create(**_long_request_args(model, "cancel me"), stream=True)
    first = next(iter(stream))
    rid = first.id
    stream.close()
    _wait_for(lambda: rid in engine.cancelled)
    output = engine.handles[rid].result(timeout=10)
    assert output.finish_reason == "cancelled" and len(output.token_ids) < LONG


def test_server_stays_responsive_during_a_long_stream(client, http, engine, model):
    """Handlers never block the event loop: other requests are served while a long stream is running."""
    stream = client.completions.create(**_long_request_args(model, "a long one"), stream=True)
    rid = next(iter(stream)).id
    t0 = time.monotonic()
    assert http.get("/health").status_code == 200
    short = http.post("/v1/completions", json={"model": model, "prompt": "short", "max_tokens": 3, "temperature": 0})
    assert short.status_code == 200 and time.monotonic() - t0 < 5
    assert not engine.handles[rid].finished
    stream.close()
    _wait_for(lambda: engine.handles[rid].finished)


def test_closing_a_chat_stream_cancels_the_request(http, engine, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "cancel this chat"}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    rid = first["id"]
    _wait_for(lambda: rid in engine.cancelled)
    assert engine.handles[rid].result(timeout=10).finish_reason == "cancelled"


def test_disconnect_while_waiting_cancels_the_request(base_url, engine, model):
    before = set(engine.handles)
    with httpx.Client(base_url=base_url, timeout=0.5) as short, pytest.raises(httpx.ReadTimeout):
        short.post("/v1/completions", json={"model": model, "prompt": "slow", "max_tokens": LONG, "ignore_eos": True})
    (rid,) = set(engine.handles) - before
    _wait_for(lambda: rid in engine.cancelled)
    assert engine.handles[rid].result(timeout=10).finish_reason == "cancelled"


# ------------------------------------------------------------------------------------------ request parsing
def test_parse_defaults():
    req = parse_completion({"prompt": "x"})
    assert req.prompts == ["x"] and not req.stream and req.sampling.max_tokens is None
    params = req.sampling.params(16)
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0 and params.stop == ()
    chat = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]})
    assert chat.messages == [{"role": "system", "content": "a"}]
    with pytest.raises(RequestError, match=r"top_p must be a number in \(0, 1\]"):
        parse_completion({"prompt": "x", "top_p": 1.5})


# ----------------------------------------------------------------------- failure paths (a stub engine, no server)
class _FailingEngine:
    """Finishes every request with finish_reason "error" after one token; reports itself as not running."""

    model_name, running, model = "stub", False, None

    def __init__(self):
        self.tokenizer = byte_tokenizer()

    def encode(self, prompt, chat=False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant:"
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, prompt, params=None, request_id=None, chat=False):
        handle = RequestHandle(request_id, 3)
        handle.push(TokenEvent(request_id, 5, "a"))
        handle.push(TokenEvent(request_id, None, "", True, "error", "RuntimeError: boom"))
        return handle

    def cancel(self, request_id):
        return False


def test_engine_failures_are_reported():
    from fastapi.testclient import TestClient

    with TestClient(create_app(_FailingEngine(), manage_engine=False), base_url="http://localhost") as stub:
        assert stub.get("/health").status_code == 503
        r = stub.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        r = stub.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        payloads = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]" and "boom" in json.loads(payloads[-2])["error"]["message"]
        assert json.loads(payloads[1])["choices"][0]["delta"] == {"content": "a"}


# ------------------------------------------------------------------------------------------------ the command
def test_parse_bytes():
    from kvtrim.cli import _parse_bytes
    from kvtrim.errors import KVTrimError

    assert _parse_bytes("256MiB") == 256 * 2**20 and _parse_bytes("1GiB") == 2**30 and _parse_bytes("1.5g") == 3 * 2**29
    assert _parse_bytes("500MB") == 500_000_000 and _parse_bytes("4096") == 4096
    for bad in ("", "0", "12 parsecs", "-1GiB", "GiB"):
        with pytest.raises(KVTrimError, match="--kv-memory"):
            _parse_bytes(bad)


def test_serve_command(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import kvtrim.serve.http as http_module
    from kvtrim.cli import app

    tiny_model("llama").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    seen = {}
    monkeypatch.setattr(http_module, "serve", lambda engine, **kw: seen.update(engine=engine, **kw))
    monkeypatch.setattr(gc, "freeze", lambda: seen.update(frozen=True))  # the command freezes before the exit
    args = ["serve", "--model", str(tmp_path), "--port", "8123", "--kv-memory", "1MiB", "--compression-rate", "4"]
    result = CliRunner().invoke(app, [*args, "--method", "kvc_w8", "--protected-window", "12", "--max-batch", "3"])
    assert result.exit_code == 0, result.output
    engine = seen["engine"]
    assert seen["port"] == 8123 and seen["host"] == "127.0.0.1" and seen["frozen"]
    assert engine.compression_rate == 4 and engine.method == "kvc_w8" and engine.protected_window == 12
    assert engine.pool.nbytes() <= 2**20 and engine.model_name == str(tmp_path)

    # --device / --dtype reach load_model: the engine's model is in the asked precision; a bad dtype names the option
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert next(seen["engine"].model.parameters()).dtype == torch.bfloat16
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--dtype", "bfloat8"])
    assert result.exit_code == 2 and "dtype" in result.output

    # without --protected-window each method keeps its preset's window (the CLI used to force 32)
    for method, window in (("kvc_w8", 8), ("kvcompress", 32)):
        result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--method", method])
        assert result.exit_code == 0, result.output
        assert seen["engine"].protected_window == window
    result = CliRunner().invoke(
        app,
        ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--max-tokens", "7", "--shutdown-timeout", "2",
         "--allowed-hosts", "box.lan", "--allowed-origins", "http://localhost:3000", "--api-key", "k1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen["limits"].max_tokens == 7 and seen["shutdown_timeout"] == 2
    security = seen["security"]
    assert security.api_key == "k1" and "box.lan" in security.allowed_hosts and "localhost" in security.allowed_hosts
    assert security.allowed_origins == ("http://localhost:3000",)
    monkeypatch.setenv("KVTRIM_API_KEY", "from-env")
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    assert seen["security"].api_key == "from-env" and seen["security"].allowed_hosts is None
    monkeypatch.delenv("KVTRIM_API_KEY")
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--max-tokens", "0"])
    assert bad.exit_code == 2 and "max_tokens" in bad.output
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-memory", "lots"])
    assert bad.exit_code == 2 and "--kv-memory" in bad.output
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "8", "--kv-memory", "1MiB"])
    assert bad.exit_code == 2
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "64", "--method", "nope"])
    assert bad.exit_code == 2 and "method" in bad.output
    # the engine's scheduling and decode options reach it; the help lists exactly the engine's methods
    result = CliRunner().invoke(
        app,
        ["serve", "--model", str(tmp_path), "--kv-blocks", "256", "--prefill-chunk", "64",
         "--max-num-batched-tokens", "256", "--decode-buckets", "--decode-kernel", "auto"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    engine = seen["engine"]
    assert engine.decode_buckets and engine.decode_kernel == "gather"  # auto on a CPU: no kernel can run
    assert (engine.scheduler.prefill_chunk, engine.scheduler.max_num_batched_tokens) == (64, 256)
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "64", "--decode-kernel", "flash"])
    assert bad.exit_code == 2 and "decode_kernel='flash' cannot be used: it needs a CUDA device" in bad.output
    bad = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-blocks", "64", "--cuda-graphs"])
    assert bad.exit_code == 2 and "CUDA" in bad.output
    from kvtrim.methods.presets import KV_COMPRESS

    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert " | ".join(KV_COMPRESS) in help_text
