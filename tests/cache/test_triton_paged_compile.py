"""kvtrim's Triton paged decode kernels built for an H100 (sm_90) on a machine without a GPU.

Triton's interpreter (tests/cache/test_triton_paged.py) runs the kernels' Python semantics but not the compiler:
it accepts code that would not compile for a GPU and says nothing about registers or memory pipelining. Triton
compiles ahead of time for a named target with its bundled ``ptxas``, no device needed, so
tests/cache/triton_sm90_build.py builds them for sm_90 as the launcher would (16-byte-aligned pointers), for
llama-8b's decode shape with and without the metric, in a process with the interpreter off; checked here: both
dots on tensor cores, K/V copied to shared memory asynchronously (pipelined), no element-by-element cache loads,
no register spills.
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("triton")

from triton_sm90_build import HAS_TOOLS, run_build

BUILD = pathlib.Path(__file__).with_name("triton_sm90_build.py")


@pytest.mark.skipif(not HAS_TOOLS, reason="this triton build bundles no ptxas/cuobjdump")
@pytest.mark.parametrize("metric", [False, True])
def test_llama_8b_decode_builds_for_sm90_without_spills(metric):
    built = run_build(BUILD, metric)
    partial, combine = built["partial"], built["combine"]
    assert partial["mma.sync"] >= 2  # q·Kᵀ and P·V on tensor cores
    assert partial["cp.async"] > 0  # K/V tiles pipelined through shared memory
    assert partial["ld.global.b16"] == 0  # no element-by-element loads of the cache
    assert partial["stack"] <= 16 and partial["reg"] <= 128, partial  # no spills; several programs fit an SM
    assert combine["stack"] == 0, combine
