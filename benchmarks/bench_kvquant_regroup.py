"""Kept keys quantized once, from the prefill's float keys, or regrouped from their codes: what the second pass costs.

A compaction regroups the kept keys of a quantized store into new key groups (docs/quantization.md, "Compaction").
A copy of an unquantized prefill (``Prefill.compressed``: what ``kvtrim.generate``, ``Session`` and ``kvtrim eval``
run) quantizes them from the prefill's float keys, once; a store that was filled quantized (a plain
``KVTrimCache.clone(kv_quant=...)``, a cache prefilled straight into quantized entries) can only dequantize its codes
and quantize them again. For each prompt of the retrieval tasks the context is prefilled once, unquantized, and
every method × ratio is compressed three ways from it: unquantized (the reference), quantized once, and quantized
from the codes. Both quantized copies score the same quantized keys, so they keep the same entries. Per row:

* the relative key error over the kept entries of every layer, ``||K_held - K_float|| / ||K_float||``;
* the continuation KL (question, answer prefix and reference answer teacher-forced) against the unquantized cache
  compressed by the same method, nats per token.

```bash
PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_kvquant_regroup.py --samples 2 --kv-quant int4 \
    --name int4
```

Writes ``benchmarks/results/bench_kvquant_regroup/NAME.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kvquant_fidelity import prompt_arguments, retrieval_prompts, write_result

OUT_DIR = Path(__file__).resolve().parent / "results" / "bench_kvquant_regroup"
ROWS = ("headkv:0.5", "kvzip:0.5", "kvzip:0.875", "snapkv:0.875", "lagkv:0.5")


def kept_positions(store) -> torch.Tensor:
    """``[batch, kv_heads, slots]`` positions of a store's (padded) view, ``-1`` where nothing is held."""
    return store.padded_positions() if hasattr(store, "padded_positions") else store.positions


def key_error(cache, prefill_cache) -> float:
    """``||K_held - K_float|| / ||K_float||`` over the kept entries of every layer of ``cache`` (the float keys are
    the prefill's at the kept entries' positions; a prompt without padding: slot = position)."""
    num = den = 0.0
    for layer, src in zip(cache.layers, prefill_cache.layers, strict=True):
        store = layer.store
        keys = store.dequantized()[0] if hasattr(store, "dequantized") else store.keys  # quantized, or dense
        pos = kept_positions(store)
        live = pos >= 0
        ref = src.store.keys.gather(2, pos.clamp(min=0)[..., None].expand(-1, -1, -1, keys.shape[-1]))
        num += float(((keys - ref)[live] ** 2).sum())
        den += float((ref[live] ** 2).sum())
    return (num / den) ** 0.5


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of ``KL(ref || other)`` from ``[batch, m, vocab]`` log-distributions."""
    from kvtrim.eval.fidelity import kl_divergence

    return float(kl_divergence(ref, other).mean())


def compare_row(model, pre, pipeline, spec, fmt, continuation: torch.Tensor) -> dict:
    """One method (``pipeline``, ``spec``; None: the full cache) on one prefill ``pre``
    (:class:`kvtrim.runtime.Prefill`, unquantized): key errors and continuation KLs of the ``fmt`` copy whose kept
    keys are quantized once and of the one whose kept keys are quantized from their codes, and whether both keep
    the same entries. ``continuation``: ``[1, m]`` ids. Call under kvtrim attention and inference mode."""
    from kvtrim.eval.fidelity import continuation_nll

    ref = pre.compressed(pipeline, spec).cache
    once = pre.compressed(pipeline, spec, fmt).cache
    codes = pre.cache.clone(pipeline, spec, fmt)  # no reference to the prefill's float keys
    if pipeline is not None:
        codes.compress(logits=pre.logits)
    lp = {
        name: continuation_nll(model, c, pre.mask, pre.logits, continuation)[1]
        for name, c in (("ref", ref), ("once", once), ("codes", codes))
    }
    same = all(
        torch.equal(kept_positions(a.store), kept_positions(b.store))
        for a, b in zip(once.layers, codes.layers, strict=True)
    )
    return {
        "key_error_once": key_error(once, pre.cache), "key_error_codes": key_error(codes, pre.cache),
        "kl_once": kl(lp["ref"], lp["once"]), "kl_codes": kl(lp["ref"], lp["codes"]), "same_kept": same,
    }  # fmt: skip


def render(summary: list[dict], settings: dict) -> str:
    lines = [
        f"Kept keys quantized once or from their codes, `{settings['kv_quant']}` (`{settings['resolved']}`), "
        f"{settings['prompts']} prompts ({settings['samples']} per task, seed {settings['seed']}, "
        f"~{settings['length']} tokens). Key error: relative, over the kept entries of every layer. KL: continuation "
        "against the unquantized cache compressed by the same method (nats per token). Means over prompts.",
        "",
        "| method | ratio | key error once | key error from codes | KL once | KL from codes | same kept entries |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['method']} | {s['ratio']} | {s['key_error_once']:.4f} | {s['key_error_codes']:.4f} | "
            f"{s['kl_once']:.5f} | {s['kl_codes']:.5f} | {s['same_kept']}/{s['prompts']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-quant", default="int4", help="a kv_quant spec")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="METHOD:RATIO (full: no eviction)")
    prompt_arguments(ap, samples=2)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvtrim
    from kvtrim.cache.quant import resolve_kv_quant
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.runtime import Prefill, observation_of, resolve_method

    fmt = resolve_kv_quant(args.kv_quant)  # a bad spec fails before the model loads
    if fmt is None:
        ap.error("--kv-quant must name a format")
    rows = []
    for row in args.rows:
        method, _, ratio = row.partition(":")
        rows.append((method, float(ratio) if ratio else None))
    model, tokenizer = kvtrim.load_model(args.model, dtype="float32", device="cpu")
    pipelines = {(m, r): resolve_method(m, r, None, None, model) for m, r in rows}
    observation = observation_of([p for p, _ in pipelines.values()])
    records = []
    for sample, ids, cont, _ in retrieval_prompts(tokenizer, args):
        with torch.inference_mode(), kvtrim_attention_enabled(model):
            pre = Prefill.plain(model, ids, torch.ones_like(ids), observation)
            for (method, ratio), (pipeline, spec) in pipelines.items():
                row = compare_row(model, pre, pipeline, spec, fmt, cont)
                records.append({"task": sample.task, "index": sample.index, "method": method, "ratio": ratio, **row})
        print(sample.task, sample.index, flush=True)
    summary = []
    for method, ratio in rows:
        mine = [r for r in records if r["method"] == method and r["ratio"] == ratio]
        summary.append({
            "method": method, "ratio": "-" if ratio is None else ratio, "prompts": len(mine),
            **{k: statistics.fmean(r[k] for r in mine) for k in ("key_error_once", "key_error_codes", "kl_once",
                                                                   "kl_codes")},
            "same_kept": sum(r["same_kept"] for r in mine),
        })  # fmt: skip
    prompts = len(records) // max(len(rows), 1)
    return write_result(args, prompts, summary, records, render, kv_quant=args.kv_quant, resolved=fmt.spec)


if __name__ == "__main__":
    main()
