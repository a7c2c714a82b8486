"""Build kvtrim's fused dequantizing Triton decode kernel for an H100 (sm_90) without a GPU and print what the
build holds (as tests/cache/triton_sm90_build.py does for the float kernel).

Run as a script in a process where Triton's interpreter is off. Prints one JSON object: per format, the partial
kernel's registers and stack bytes per thread and counts of the PTX instructions that matter here.

Usage: ``python tests/cache/triton_sm90_build_quant.py METRIC`` (``0`` or ``1``); llama-8b's decode shape: bf16,
G = 4, head_dim 128, 16-token blocks, one scale per entry, 64-token tiles, 4 warps, 2 stages.
"""

from __future__ import annotations

import json
import sys

from triton_sm90_build import build

from kvtrim.cache import triton_paged_quant as tq

PARTIAL = {
    "q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vc_ptr": "*u8", "vs_ptr": "*fp16",
    "vz_ptr": "*fp16", "table_ptr": "*i32", "len_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32",
    "acc_ptr": "*fp32", "score_ptr": "*fp32", "stride_qr": "i32", "stride_qg": "i32", "stride_tr": "i32",
    "chunk": "i32", "score_len": "i32", "n_splits": "i32", "scale_log2": "fp32",
}  # fmt: skip


def main(metric: bool) -> dict:
    tq._bind_device_functions(False)
    partial = tq._partial(False)[0]
    result = {}
    for fmt, code in tq._FMT_CODE.items():
        consts = dict(G=4, G_PAD=16, BS=16, D=128, HALF=64, HALF_PAD=64, FMT=code, GROUPS=1, VG=128, NATIVE_FP8=True,
                      METRIC=metric, PRECISION="tf32", DOT_F32=False, BLOCK_N=64)  # fmt: skip
        result[fmt] = build(partial, PARTIAL, consts, num_warps=4, num_stages=2)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] == "1")))
