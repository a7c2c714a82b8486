"""The engine with decode_kernel="triton" generates the gather path's tokens, with compression at cr 4 and the
continual metric fused into the kernel, eager, with decode buckets, and through the static decode step; one kernel
launch per layer and step. On a CPU the kernel runs under Triton's interpreter (tests/conftest.py turns it on when
there is no CUDA; tests/cache/test_triton_paged.py) and the tokens are identical; on CUDA the compiled kernel runs,
the static step is also captured into CUDA graphs, and the tokens agree up to near-ties (another summation order
than SDPA's). Without CUDA and without the interpreter, "triton" is refused."""

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

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
if not CUDA and not INTERPRETED:
    pytest.skip("without CUDA the kernel runs only under TRITON_INTERPRET=1 (conftest.py)", allow_module_level=True)
# (decode_buckets, static step, CUDA graphs): graphs cannot capture the interpreter
RUNS = [(False, False, False), (True, False, False), (True, True, False)] + ([(True, True, True)] if CUDA else [])


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama").to("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _run(
    model, tok, decode_kernel: str, decode_buckets: bool, static: bool = False, graphs: bool = False
) -> tuple[list[list[int]], Engine]:
    return run_compressed(
        model, tok, requests=3, max_tokens=10, decode_buckets=decode_buckets, decode_kernel=decode_kernel,
        static_decode=static and not graphs, cuda_graphs=graphs,
    )  # fmt: skip


@pytest.mark.parametrize(("decode_buckets", "static", "graphs"), RUNS)
def test_engine_with_the_triton_kernel_generates_the_gather_paths_tokens(monkeypatch, model, tok, decode_buckets,
                                                                         static, graphs):  # fmt: skip
    want, _ = _run(model, tok, "gather", decode_buckets)
    module = paged_kernels._load_triton()
    calls = []
    real = module.paged_decode

    def counted(*args, **kwargs):
        calls.append("metric" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "paged_decode", counted)
    got, triton_engine = _run(model, tok, "triton", decode_buckets, static, graphs)
    if CUDA:
        agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        assert agree >= 0.9 * sum(len(w) for w in want), (got, want)
    else:
        assert got == want
    stats = triton_engine.stats
    assert (triton_engine.decode_kernel, stats.decode_kernel) == ("triton", "triton")
    assert stats.static_decode_steps == (stats.decode_steps if static and not graphs else 0)
    assert stats.graph_replays == (stats.decode_steps if graphs else 0)
    assert stats.compressions > 0 and stats.decode_steps > 0
    if not graphs:  # a replay launches the captured kernels without calling Python
        # one launch per layer and step, and the one test call that chose the kernel
        assert len(calls) == stats.decode_steps * model.config.num_hidden_layers + 1
    assert calls and all(calls)  # the continual metric went into every launch


def test_engine_triton_without_cuda_or_interpreter_is_refused(monkeypatch, tok):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu_model = tiny_model("llama")  # on the CPU whatever the machine has
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='triton' cannot be used: it needs a CUDA device"):
        Engine(cpu_model, tok, kv_blocks=8, block_size=16, decode_kernel="triton")
