"""Engine checks that need a CUDA device (skipped elsewhere; CI has none). They close what the CPU tests cannot:
that the static decode step captures into CUDA graphs and replays to the eager tokens, that the decode kernels run
on real hardware, and that the two compose. Everything built here (model, options) is built on the CPU by
tests/serve/test_engine_cuda_cases.py, so these tests can fail only because of CUDA. On a GPU machine they run in
the ``tests`` stage of ``benchmarks/gpu_check.sh`` (docs/gpu-check.md)."""

from __future__ import annotations

import cuda_engine_cases as cases
import pytest
import torch

from conftest import byte_tokenizer
from kvtrim.cache.paged_kernels import resolve_decode_kernel
from kvtrim.errors import InvalidParameterError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _kernel_or_skip(name: str, model, dtype: torch.dtype) -> None:
    try:
        resolve_decode_kernel(name, **cases.kernel_args(model, dtype))
    except InvalidParameterError as exc:
        pytest.skip(str(exc))


def test_cuda_graph_replays_give_the_eager_tokens(tok):
    """Replays run the very kernels of the static step run eagerly (``static_decode``): the tokens are identical."""
    model = cases.cuda_model(torch.float32)
    static, graphs, plain = cases.GRAPH_RUNS
    want, eager = cases.run(model, tok, **static)
    got, captured = cases.run(model, tok, **graphs)
    assert got == want
    plain_tokens, _ = cases.run(model, tok, **plain)  # and the unpadded eager engine agrees in fp32
    assert plain_tokens == want
    s = captured.stats
    assert s.graph_captures >= 1 and s.graph_replays == s.decode_steps and s.compressions == eager.stats.compressions


@pytest.mark.parametrize("kernel", cases.KERNELS)
@pytest.mark.parametrize("dtype", cases.KERNEL_DTYPES)
def test_decode_kernel_matches_the_gather_path(tok, kernel, dtype):
    model = cases.cuda_model(dtype)
    _kernel_or_skip(kernel, model, dtype)
    want, _ = cases.run(model, tok, decode_kernel="gather")
    got, engine = cases.run(model, tok, decode_kernel=kernel)
    assert engine.stats.decode_kernel != "gather"
    # Half precision: the kernels sum in another order than SDPA, so a near-tie may flip a late greedy token.
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert agree >= 0.9 * sum(len(w) for w in want), (got, want)


@pytest.mark.parametrize("kernel", cases.CAPTURE_KERNELS)
def test_cuda_graphs_capture_every_decode_kernel(tok, kernel):
    model = cases.cuda_model(cases.CAPTURE_DTYPE)
    if kernel != "gather":
        _kernel_or_skip(kernel, model, cases.CAPTURE_DTYPE)
    static, graphs = cases.capture_runs(kernel)
    want, _ = cases.run(model, tok, **static)
    got, captured = cases.run(model, tok, **graphs)
    assert got == want  # the static step's kernels, replayed: identical arithmetic
    assert captured.stats.graph_replays == captured.stats.decode_steps > 0
