"""kvtrim's fused dequantizing Triton decode kernel built for an H100 (sm_90) on a machine without a GPU.

The interpreter (tests/cache/test_triton_paged_quant.py) checks what the kernel computes, not that it compiles:
tests/cache/triton_sm90_build_quant.py builds its partial kernel for sm_90 with Triton's bundled ``ptxas`` for
llama-8b's decode shape (bf16, G = 4, head_dim 128, 64-token tiles, the metric on) and each format, in a process
with the interpreter off; checked here: both dots on tensor cores, no register spills, and for the one-byte codes
(int8, fp8) the code rows copied to shared memory asynchronously (pipelined).
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("triton")

from triton_sm90_build import HAS_TOOLS, run_build

BUILD = pathlib.Path(__file__).with_name("triton_sm90_build_quant.py")


@pytest.mark.skipif(not HAS_TOOLS, reason="this triton build bundles no ptxas/cuobjdump")
def test_fused_dequantizing_decode_builds_for_sm90_without_spills():
    built = run_build(BUILD, True)
    assert set(built) == {"int8", "int4", "fp8"}
    for fmt, partial in built.items():
        assert partial["mma.sync"] >= 2, (fmt, partial)  # q·Kᵀ and P·V on tensor cores
        assert partial["stack"] <= 16 and partial["reg"] <= 168, (fmt, partial)  # no spills
    for fmt in ("int8", "fp8"):
        assert built[fmt]["cp.async"] > 0, built[fmt]  # the code rows pipelined through shared memory
