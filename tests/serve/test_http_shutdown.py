"""Graceful shutdown of a real ``kvtrim serve`` process on 127.0.0.1 (tiny model): drain, abort with an error
event and ``[DONE]``, a second signal aborts at once, the engine is stopped, exit status 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import byte_tokenizer, tiny_model

LONG = 1900  # tokens: far longer than any drain in these tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-serve")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


class Served:
    def __init__(self, model_dir: Path, *extra: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvtrim", "serve", "--model", str(model_dir), "--port", str(self.port)]
        cmd += ["--kv-blocks", "1200", "--threads", "1", "--log-level", "info", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"the server did not exit within {timeout} s: {err[-3000:]}")
        return self.proc.returncode, err


class Stream(threading.Thread):
    """A long streaming completion read in the background; ``payloads`` are its SSE data lines."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.payloads, self.started = url, [], threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        body = {"prompt": "shut down", "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.payloads.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except Exception as exc:
            self.error = exc
        self.started.set()

    def tokens(self) -> int:
        return sum(1 for p in self.payloads if isinstance(p, dict) and "choices" in p)


def _assert_aborted(stream: Stream) -> None:
    assert stream.error is None, stream.error
    assert stream.payloads[-1] == "[DONE]", stream.payloads[-3:]
    error = stream.payloads[-2]["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    assert 0 < stream.tokens() < LONG


def test_idle_sigterm_exits_0(model_dir):
    """uvicorn alone re-raises SIGTERM after its shutdown: status 143 even when idle."""
    served = Served(model_dir)
    t0 = time.monotonic()
    served.signal(signal.SIGTERM)
    code, err = served.finish(timeout=30)
    assert code == 0, err[-3000:]
    assert "kvtrim: engine stopped" in err
    assert time.monotonic() - t0 < 15


def test_sigterm_drains_then_aborts(model_dir):
    served = Served(model_dir, "--shutdown-timeout", "1.5")
    stream = Stream(served.url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    waiting: dict = {}

    def wait_request():  # a non-streaming request that is running when the abort comes
        body = {"prompt": "wait", "max_tokens": LONG, "ignore_eos": True}
        waiting["r"] = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)

    waiter = threading.Thread(target=wait_request, daemon=True)
    waiter.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    served.signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):  # no new connections while draining
        httpx.get(f"{served.url}/health", timeout=2)
    code, err = served.finish(timeout=60)
    elapsed = time.monotonic() - t0
    stream.join(10)
    waiter.join(10)
    assert code == 0, err[-3000:]
    assert 1.5 <= elapsed < 15, elapsed
    _assert_aborted(stream)
    assert waiting["r"].status_code == 503 and waiting["r"].json()["error"]["code"] == "server_shutdown"
    assert "kvtrim: engine stopped" in err


def test_second_signal_aborts_at_once(model_dir):
    served = Served(model_dir, "--shutdown-timeout", "120")
    stream = Stream(served.url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    served.signal(signal.SIGTERM)
    time.sleep(1.0)
    draining = stream.tokens()
    assert stream.is_alive() and draining > 0  # the drain lets it run
    t0 = time.monotonic()
    served.signal(signal.SIGINT)
    code, err = served.finish(timeout=60)
    stream.join(10)
    assert code == 0, err[-3000:]
    assert time.monotonic() - t0 < 10
    _assert_aborted(stream)
    assert "kvtrim: engine stopped" in err and "second signal" in err
