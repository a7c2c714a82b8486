"""Every model and engine option set of the CUDA engine tests (tests/serve/cuda_engine_cases.py), built and run on
the CPU, so that a CUDA test can fail only because of CUDA.

What exists only on CUDA gets its CPU counterpart: ``cuda_graphs`` runs as ``static_decode`` (the same static step
without the capture); the flash-attention kernels cannot run here, so their resolution is checked to refuse the CPU
pool for that reason alone and the rest of the option set runs on the gather path; the Triton kernel runs under
Triton's interpreter when it is on.
"""

from __future__ import annotations

import os

import cuda_engine_cases as cases
import pytest
import torch

from conftest import byte_tokenizer
from kvtrim.cache.paged_kernels import resolve_decode_kernel
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(1)
    return byte_tokenizer()


def _runs() -> list[tuple[torch.dtype, dict]]:
    """(dtype, options) of every engine run the CUDA tests make, each once."""
    runs = [(torch.float32, o) for o in cases.GRAPH_RUNS]
    for dtype in cases.KERNEL_DTYPES:
        runs += [(dtype, {"decode_kernel": k}) for k in ("gather", *cases.KERNELS)]
    for kernel in cases.CAPTURE_KERNELS:
        runs += [(cases.CAPTURE_DTYPE, o) for o in cases.capture_runs(kernel)]
    unique = []
    for run in runs:
        if run not in unique:
            unique.append(run)
    return unique


RUNS = _runs()
DTYPES = sorted({dtype for dtype, _ in RUNS}, key=str)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_model_builds_with_the_head_dim_the_kernel_checks_use(tok, dtype):
    model = cases.cuda_model(dtype, device="cpu")
    args = cases.kernel_args(model, dtype)
    assert args["head_dim"] == cases.HEAD_DIM and args["head_dim"] % 8 == 0 and args["head_dim"] <= 256
    assert next(model.parameters()).dtype == dtype
    engine = Engine(model, tok, kv_blocks=8, block_size=cases.BLOCK_SIZE)
    assert engine.pool.head_dim == args["head_dim"] and engine.pool.block_size == args["block_size"]


def _on_cpu(options: dict) -> dict:
    cpu = dict(options)
    if cpu.pop("cuda_graphs", False):
        cpu["static_decode"] = True
    return cpu


@pytest.mark.parametrize(("dtype", "options"), RUNS, ids=[f"{str(d)[6:]}-{o}" for d, o in RUNS])
def test_every_cuda_engine_run_runs_on_the_cpu(tok, dtype, options):
    cpu = _on_cpu(options)
    model = cases.cuda_model(dtype, device="cpu")
    kernel = cpu.get("decode_kernel", "gather")
    if kernel == "flash":  # CUDA-only: refused here for the device alone; the rest of the options run on gather
        with pytest.raises(InvalidParameterError, match="decode_kernel='flash' cannot be used: it needs a CUDA device"):
            resolve_decode_kernel("flash", **cases.kernel_args(model, dtype))
        cpu["decode_kernel"] = kernel = "gather"
    if kernel == "triton":
        pytest.importorskip("triton")
        if not INTERPRETED:
            pytest.skip("the Triton kernel runs on a CPU only under Triton's interpreter")
        assert resolve_decode_kernel("triton", **cases.kernel_args(model, dtype)).name == "triton"
    tokens, engine = cases.run(model, tok, requests=2, max_tokens=8, **cpu)
    stats = engine.stats
    assert stats.decode_kernel == kernel and stats.decode_steps > 0 and all(len(t) == 8 for t in tokens)
    assert stats.static_decode_steps == (stats.decode_steps if cpu.get("static_decode") else 0)
