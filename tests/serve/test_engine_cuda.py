"""Engine checks that need a CUDA device (skipped elsewhere; CI has none). They close what the CPU tests cannot:
that the static decode step captures into CUDA graphs and replays to the eager tokens, that the decode kernels run
on real hardware, and that the two compose. On a GPU machine they run in the ``tests`` stage of
``benchmarks/gpu_check.sh`` (docs/gpu-check.md)."""

from __future__ import annotations

import pytest
import torch

from compressed_engine_run import run_compressed
from conftest import byte_tokenizer, tiny_model
from kvtrim.cache.paged_kernels import resolve_decode_kernel
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _model(dtype: torch.dtype):
    # head_dim 32: within every kernel's limits (a multiple of 8, at most 256)
    return tiny_model("llama", layers=2, heads=6, kv_heads=2).to(device="cuda", dtype=dtype)


def _run(model, tok, **options) -> tuple[list[list[int]], Engine]:
    return run_compressed(model, tok, requests=6, max_tokens=24, kv_blocks=160, length_step=13, **options)


def _kernel_or_skip(name: str, dtype: torch.dtype) -> None:
    try:
        resolve_decode_kernel(name, device="cuda", dtype=dtype, block_size=16, head_dim=32)
    except InvalidParameterError as exc:
        pytest.skip(str(exc))


def test_cuda_graph_replays_give_the_eager_tokens(tok):
    """Replays run the very kernels of the static step run eagerly (``static_decode``): the tokens are identical."""
    model = _model(torch.float32)
    want, eager = _run(model, tok, decode_buckets=True, static_decode=True)
    got, graphs = _run(model, tok, decode_buckets=True, cuda_graphs=True)
    assert got == want
    plain, _ = _run(model, tok)  # and the unpadded eager engine agrees in fp32
    assert plain == want
    s = graphs.stats
    assert s.graph_captures >= 1 and s.graph_replays == s.decode_steps and s.compressions == eager.stats.compressions


@pytest.mark.parametrize("kernel", ["flash", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_matches_the_gather_path(tok, kernel, dtype):
    _kernel_or_skip(kernel, dtype)
    model = _model(dtype)
    want, _ = _run(model, tok, decode_kernel="gather")
    got, engine = _run(model, tok, decode_kernel=kernel)
    assert engine.stats.decode_kernel != "gather"
    # Half precision: the kernels sum in another order than SDPA, so a near-tie may flip a late greedy token.
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert agree >= 0.9 * sum(len(w) for w in want), (got, want)


@pytest.mark.parametrize("kernel", ["gather", "flash", "triton"])
def test_cuda_graphs_capture_every_decode_kernel(tok, kernel):
    dtype = torch.bfloat16
    if kernel != "gather":
        _kernel_or_skip(kernel, dtype)
    model = _model(dtype)
    want, _ = _run(model, tok, decode_buckets=True, static_decode=True, decode_kernel=kernel)
    got, graphs = _run(model, tok, decode_buckets=True, cuda_graphs=True, decode_kernel=kernel)
    assert got == want  # the static step's kernels, replayed: identical arithmetic
    assert graphs.stats.graph_replays == graphs.stats.decode_steps > 0
