"""Build kvtrim's Triton paged decode kernels for an H100 (sm_90) without a GPU and print what the build holds.

Run as a script in a process where Triton's interpreter is off (``TRITON_INTERPRET`` unset): Triton wraps its own
library functions in the mode in force when it is first imported, so a process that imported it interpreted
cannot compile. Prints one JSON object: per kernel, its registers and stack bytes per thread (from the cubin, with
the ``cuobjdump`` Triton bundles) and counts of the PTX instructions that matter here.

Usage: ``python tests/cache/triton_sm90_build.py METRIC`` (``0`` or ``1``); llama-8b's decode shape: bf16,
G = 4, head_dim 128, 16-token blocks, 64-token tiles, 4 warps, 2 stages. The tests run it (and the other build
scripts) through :func:`run_build`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvtrim.cache import triton_paged as tp

SM90 = GPUTarget("cuda", 90, 32)
BUNDLED = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUOBJDUMP = BUNDLED / "cuobjdump"
HAS_TOOLS = (BUNDLED / "ptxas").exists() and CUOBJDUMP.exists()  # this triton build bundles ptxas and cuobjdump
ALIGNED = ("stride_qr", "stride_qg", "chunk", "score_len")  # multiples of 16 at this shape: the launcher says so too
PARTIAL = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "len_ptr": "*i32", "m_ptr": "*fp32",
    "l_ptr": "*fp32", "acc_ptr": "*fp32", "score_ptr": "*fp32", "stride_qr": "i32", "stride_qg": "i32",
    "stride_tr": "i32", "chunk": "i32", "score_len": "i32", "n_splits": "i32", "scale_log2": "fp32",
}  # fmt: skip
COMBINE = {
    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
    "score_ptr": "*fp32", "table_ptr": "*i32", "len_ptr": "*i32", "metric_ptr": "*fp32", "pos_ptr": "*i64",
    "qpos_ptr": "*i64", "stride_tr": "i32", "stride_or": "i32", "stride_og": "i32", "chunk": "i32",
    "score_len": "i32", "n_splits": "i32", "heads": "i32", "buffer": "i32",
}  # fmt: skip
PTX = ("mma.sync", "cp.async", "ld.global.b16")


def build(fn, types: dict[str, str], consts: dict, num_warps: int, num_stages: int) -> dict:
    signature = {name: ("constexpr" if name in consts else types[name]) for name in fn.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name not in consts and (types[name].startswith("*") or name in ALIGNED)
    }
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    used = {key.lower(): int(re.search(rf"{key}:(\d+)", text).group(1)) for key in ("REG", "STACK")}
    return {**used, "shared": kernel.metadata.shared, **{p: kernel.asm["ptx"].count(p) for p in PTX}}


def run_build(script: pathlib.Path, metric: bool) -> dict:
    """What ``script`` (this file or another build script) prints, run in a new process with Triton's interpreter
    off and ``src`` first on the path; fails with the end of its stderr when it does."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parents[2] / "src"),
                                                      env.get("PYTHONPATH")]))  # fmt: skip
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(script), "1" if metric else "0"], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(metric: bool) -> dict:
    partial, _, combine = tp._kernels(False)
    consts = dict(G=4, G_PAD=16, BS=16, D=128, D_PAD=128, METRIC=metric, PRECISION="tf32", DOT_F32=False, BLOCK_N=64)
    result = {"partial": build(partial, PARTIAL, consts, num_warps=4, num_stages=2)}
    consts = dict(G=4, G_PAD=4, BS=16, D=128, D_PAD=128, METRIC=metric, BLOCK_M=tp.METRIC_BLOCK)
    result["combine"] = build(combine, COMBINE, consts, num_warps=4, num_stages=1)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] == "1")))
