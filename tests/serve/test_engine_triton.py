"""The engine with decode_kernel="triton" (kvtrim's Triton kernel under Triton's interpreter on this CPU, see
tests/cache/test_triton_paged.py) generates exactly the gather path's tokens, with compression at cr 4 and the
continual metric fused into the kernel, eager, with decode buckets, and through the static decode step; one kernel
launch per layer and step. Without CUDA and without the interpreter, "triton" is refused."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from compressed_engine_run import run_compressed
from conftest import byte_tokenizer, tiny_model
from kvtrim.cache import paged_kernels
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
    pytest.skip("the engine test runs the kernel under TRITON_INTERPRET=1 (tests/conftest.py)", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _run(model, tok, decode_kernel: str, decode_buckets: bool, static: bool = False) -> tuple[list[list[int]], Engine]:
    return run_compressed(
        model, tok, requests=3, max_tokens=10, decode_buckets=decode_buckets, decode_kernel=decode_kernel,
        static_decode=static,
    )  # fmt: skip


@pytest.mark.parametrize(("decode_buckets", "static"), [(False, False), (True, False), (True, True)])
def test_engine_with_the_triton_kernel_generates_the_gather_paths_tokens(monkeypatch, model, tok, decode_buckets,
                                                                         static):  # fmt: skip
    want, _ = _run(model, tok, "gather", decode_buckets)
    module = paged_kernels._load_triton()
    calls = []
    real = module.paged_decode

    def counted(*args, **kwargs):
        calls.append("metric" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "paged_decode", counted)
    got, triton_engine = _run(model, tok, "triton", decode_buckets, static)
    assert got == want
    stats = triton_engine.stats
    assert (triton_engine.decode_kernel, stats.decode_kernel) == ("triton", "triton")
    assert stats.static_decode_steps == (stats.decode_steps if static else 0)
    assert stats.compressions > 0 and stats.decode_steps > 0
    # one launch per layer and step, and the one test call that chose the kernel
    assert len(calls) == stats.decode_steps * model.config.num_hidden_layers + 1
    assert all(calls)  # the continual metric went into every launch


def test_engine_triton_without_cuda_or_interpreter_is_refused(monkeypatch, model, tok):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='triton' cannot be used: it needs a CUDA device"):
        Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="triton")
