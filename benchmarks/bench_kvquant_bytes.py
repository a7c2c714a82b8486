"""Bytes a quantized dense store holds after keeping a fraction of a long context, per ``kv_quant`` setting.

For each context length and each ``--kv-quant`` spec, one KV head's
:class:`~kvtrim.cache.quantized_dense.QuantizedDenseStore` is fed the context's entries (random tensors in the
model's dtype, no model), keeps a random ``1 - ratio`` of them (the compaction every dense-layout method does, e.g.
SnapKV at ratio 0.875), and its bytes are read from the tensors (``store.nbytes()``: packed codes, scales, zero
points, the full-precision window and the sink). Every KV head of every layer holds the same, so the model's bytes are
``layers x kv_heads`` times one head's, and the fraction of the model-dtype full cache is one head's. Defaults:
Llama-3.1-8B's shape (32 layers, 8 KV heads, head_dim 128, float16) at 32,768 tokens.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_kvquant_bytes.py \
        --out benchmarks/results/bench_kvquant_bytes/llama8b_32k.json

writes the JSON (every row and the settings) and the markdown table next to it (``.md``), and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvtrim.cache.quant import resolve_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore

# int4's default, then the settings it was chosen among (rotation changes no byte)
DEFAULT_SPECS = (
    "int4", "int4:group_size=32,sink=0", "int4:group_size=32,residual=0,sink=0", "int4:sink=0",
    "int4:residual=0,sink=0", "int8", "fp8",
)  # fmt: skip
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def one_head(spec: str, context: int, kept: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """The bytes one KV head's quantized dense store holds after keeping ``kept`` of ``context`` entries."""
    fmt = resolve_kv_quant(spec)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, context, head_dim, generator=g).to(dtype)
    values = torch.randn(1, 1, context, head_dim, generator=g).to(dtype)
    store = QuantizedDenseStore.empty(1, 1, head_dim, dtype, "cpu", fmt)
    store.append(keys, values, torch.arange(context)[None], padded=False)
    store.keep(torch.randperm(context, generator=g)[:kept].sort().values.view(1, 1, kept))
    return {
        "kv_quant": spec,
        "resolved": fmt.spec,
        "group_size": fmt.group_size,
        "residual": fmt.residual,
        "sink": fmt.sink,
        "quantized_entries": store.quantized_length,
        "window_entries": store.window_length,
        "sink_entries": store.sink_length,
        "head_bytes": store.nbytes(),
        "quantized_entry_bytes": fmt.entry_bytes(head_dim),
    }


def run(args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    elt = torch.empty(0, dtype=dtype).element_size()
    heads = args.layers * args.kv_heads
    rows = []
    for context in args.contexts:
        kept = max(1, round(context * (1 - args.ratio)))  # kept entries per head
        full_head = context * 2 * args.head_dim * elt
        plain = kept * 2 * args.head_dim * elt
        rows.append(
            {"context": context, "kept": kept, "kv_quant": "none", "resolved": None, "group_size": None,
             "residual": None, "sink": None, "quantized_entries": 0, "window_entries": kept, "sink_entries": 0,
             "head_bytes": plain, "quantized_entry_bytes": None}
        )  # fmt: skip
        for spec in args.kv_quant:
            rows.append({"context": context, "kept": kept, **one_head(spec, context, kept, args.head_dim, dtype)})
        for row in rows:
            if row["context"] == context:
                row["model_bytes"] = row["head_bytes"] * heads
                row["bytes_per_kept_entry"] = row["head_bytes"] / kept
                row["full_cache_over_held"] = full_head / row["head_bytes"]
                row["meets_1_28"] = row["head_bytes"] * 28 <= full_head
    settings = {
        "contexts": args.contexts, "ratio": args.ratio, "layers": args.layers, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "dtype": args.dtype,
    }  # fmt: skip
    return {"settings": settings, "rows": rows}


def table(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Ratio {s['ratio']} ({s['layers']} layers x {s['kv_heads']} KV heads, head_dim {s['head_dim']}, "
        f"{s['dtype']}); 'of the full cache' = the {s['dtype']} full cache's bytes / the bytes held.",
        "",
        "| context | kv_quant | resolved | quantized entries / window / sink (per head) | B per kept entry "
        "| model MiB held | of the full cache | ≤ 1/28 |",
        "|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        resolved = f"`{r['resolved']}`" if r["resolved"] else "-"
        meets = "yes" if r["meets_1_28"] else "no"
        lines.append(
            f"| {r['context']:,} | `{r['kv_quant']}` | {resolved} | "
            f"{r['quantized_entries']:,} / {r['window_entries']:,} / {r['sink_entries']:,} | "
            f"{r['bytes_per_kept_entry']:.1f} | "
            f"{r['model_bytes'] / 2**20:.2f} | 1/{r['full_cache_over_held']:.2f} | {meets} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768], help="context lengths (tokens)")
    parser.add_argument("--ratio", type=float, default=0.875, help="fraction of the entries removed")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="the model's dtype")
    parser.add_argument("--kv-quant", nargs="+", default=list(DEFAULT_SPECS), help="kv_quant specs to measure")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_kvquant_bytes/bytes.json"))
    args = parser.parse_args(argv)
    if not 0 <= args.ratio < 1:
        parser.error(f"--ratio must be in [0, 1), got {args.ratio}")
    result = run(args)
    md = table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    return result


if __name__ == "__main__":
    main()
