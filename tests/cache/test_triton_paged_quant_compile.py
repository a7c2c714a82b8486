"""kvtrim's fused dequantizing Triton decode kernel built for an H100 (sm_90) on a machine without a GPU.

The interpreter (tests/cache/test_triton_paged_quant.py) checks what the kernel computes, not that it compiles:
tests/cache/triton_sm90_build_quant.py builds its partial kernel for sm_90 with Triton's bundled ``ptxas`` for
llama-8b's decode shape (bf16, G = 4, head_dim 128, 64-token tiles, the metric on) and each format, in a process
with the interpreter off; checked here: both dots on tensor cores, no register spills, and for the one-byte codes
(int8, fp8) the code rows copied to shared memory asynchronously (pipelined).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

BUILD = pathlib.Path(__file__).with_name("triton_sm90_build_quant.py")
BUNDLED = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(
    not (BUNDLED / "ptxas").exists() or not (BUNDLED / "cuobjdump").exists(),
    reason="this triton build bundles no ptxas/cuobjdump",
)
def test_fused_dequantizing_decode_builds_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BUILD.parents[2] / "src"), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(BUILD), "1"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(built) == {"int8", "int4", "fp8"}
    for fmt, partial in built.items():
        assert partial["mma.sync"] >= 2, (fmt, partial)  # q·Kᵀ and P·V on tensor cores
        assert partial["stack"] <= 16 and partial["reg"] <= 168, (fmt, partial)  # no spills
    for fmt in ("int8", "fp8"):
        assert built[fmt]["cp.async"] > 0, built[fmt]  # the code rows pipelined through shared memory
