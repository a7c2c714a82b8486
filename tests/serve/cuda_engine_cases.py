"""What the CUDA engine tests build, stated once: their model and their engine option sets.

tests/serve/test_engine_cuda.py runs these on CUDA; tests/serve/test_engine_cuda_cases.py builds every one of them on
the CPU (and runs each whose options exist there), so a CUDA test can fail only because of CUDA.
"""

from __future__ import annotations

import torch

from compressed_engine_run import run_compressed
from conftest import tiny_model
from kvtrim.serve.engine import Engine

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32  # GQA groups of 3; head_dim within every kernel's limits (multiple of 8, <= 256)
BLOCK_SIZE = 16  # the engine runs' block size (compressed_engine_run.py): vLLM's fork needs multiples of 16

# The engine options of each CUDA test, by test. ``cuda_graphs`` has a CPU counterpart: ``static_decode`` runs the
# same static step without the capture.
GRAPH_RUNS = ({"decode_buckets": True, "static_decode": True}, {"decode_buckets": True, "cuda_graphs": True}, {})
KERNELS = ("flash", "triton")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
CAPTURE_KERNELS = ("gather", "flash", "triton")
CAPTURE_DTYPE = torch.bfloat16


def capture_runs(kernel: str) -> tuple[dict, dict]:
    """The static step eagerly, then captured into graphs, with ``kernel``."""
    return (
        {"decode_buckets": True, "static_decode": True, "decode_kernel": kernel},
        {"decode_buckets": True, "cuda_graphs": True, "decode_kernel": kernel},
    )


def cuda_model(dtype: torch.dtype, device: str = "cuda"):
    """The model of every CUDA engine test: 2 layers, 6 query heads over 2 KV heads, head_dim 32."""
    model = tiny_model("llama", layers=2, heads=HEADS, kv_heads=KV_HEADS, hidden=HEADS * HEAD_DIM)
    return model.to(device=device, dtype=dtype)


def kernel_args(model, dtype: torch.dtype) -> dict:
    """The arguments a test gives ``resolve_decode_kernel`` to decide whether a kernel can run: the model's own."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(device=next(model.parameters()).device, dtype=dtype, block_size=BLOCK_SIZE, head_dim=head_dim)


def run(model, tok, requests: int = 6, max_tokens: int = 24, **options) -> tuple[list[list[int]], Engine]:
    """One compressing engine run (cr 4) of ``requests`` prompts; ``options`` go to the Engine."""
    return run_compressed(model, tok, requests=requests, max_tokens=max_tokens, kv_blocks=160, length_step=13,
                          **options)  # fmt: skip
