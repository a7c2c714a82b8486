"""Helpers for the HTTP tests: a real uvicorn server on 127.0.0.1 (in a thread) over a real tiny-model Engine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from conftest import byte_tokenizer, tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_engine(kv_blocks: int = 512, **kwargs):
    """An Engine over the tiny random-weight Llama and the byte tokenizer (with a chat template)."""
    from kvtrim.serve.engine import Engine

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return Engine(tiny_model("llama"), tokenizer, kv_blocks=kv_blocks, block_size=16, seed=0, **kwargs)


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port for the duration of the block; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
