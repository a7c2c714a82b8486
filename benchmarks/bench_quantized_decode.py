"""Bytes held and decode speed of quantized entries (int8 / int4 / fp8) vs the model's dtype, SmolLM2-135M on CPU.

One ~1k-token prompt is prefilled once. For every entry format (``none`` = float32 as the model runs, ``int8``,
``int4``) and every method (``full``: nothing evicted; ``snapkv`` and ``adakv`` at ratio 0.875; ``adakv`` also with
``layout="dense"``, its per-head counts padded to the longest head in a dense store), a copy of the prefilled cache
is quantized, compressed, and decodes ``--tokens`` greedy tokens with end-of-sequence ignored, so every run holds
the same number of entries per step as the others of its method. Reported per run: key/value bytes held after
compression (measured from the store tensors) and their ratio to a float16 cache of the same context, decode
milliseconds per token (wall and CPU time of this process; the best of ``--reps`` runs), and how many generated
tokens equal the unquantized run's of the same method.

``--methods think think_snapkv`` runs ThinK (ratio 0.5 of the key channels, no token evicted) and ThinK on SnapKV
(ratio 0.875 of the tokens, half of the kept keys' channels) instead: channel-pruned keys, quantized or not.

``--formats`` names the entry formats to run, ``none`` and any ``kv_quant`` spec (``int8:sink=0``,
``int4:group_size=64``); the first is the reference of "tokens = unquantized", so it should be ``none``.

``--layer-only`` measures instead the two parts of one layer's decoding step on a SmolLM2-shaped layer (3 KV
heads, 9 query heads, head_dim 64, ``--length`` entries, float32): dequantizing the keys and values into the
attention buffer, and the attention call itself (CPU time, the median of 300 calls).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_quantized_decode.py            # ~6 min
    OMP_NUM_THREADS=1 python benchmarks/bench_quantized_decode.py --quick    # smoke run
    OMP_NUM_THREADS=1 python benchmarks/bench_quantized_decode.py --layer-only   # per-layer costs, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.cache.packed_attention import attend_padded
from kvtrim.cache.quant import (
    KVQuant,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
    resolve_kv_quant,
)
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.eval.tasks import generate_task
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.prompts import prompt_template
from kvtrim.runtime import Prefill, greedy_decode

MODEL = "smollm2-135m"
FORMATS = ("none", "int8", "int4", "fp8")
# (label, method, ratio, layout)
METHODS = (
    ("full", None, None, None),
    ("snapkv", "snapkv", 0.875, None),
    ("adakv", "adakv", 0.875, None),
    ("adakv padded", "adakv", 0.875, "dense"),
)
# run with --methods (key-channel pruning: ThinK's ratio is the fraction of key channels pruned)
EXTRA_METHODS = (
    ("think", "think", 0.5, None),
    ("think_snapkv", "think_snapkv", 0.875, None),
)


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, ~length]`` a passkey prompt (context and question)."""
    sample = generate_task("passkey", tokenizer, length, 1, seed=3)[0]
    template = prompt_template(tokenizer, True)
    text = template.context_part(sample.context) + template.question_part(sample.question, sample.answer_prefix)
    return tokenizer(text, return_tensors="pt", add_special_tokens=template.prefix == "")["input_ids"]


def _cpu_us(fn, calls: int = 300) -> float:
    """Median CPU microseconds of ``fn()`` over ``calls`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.process_time_ns()
        fn()
        times.append((time.process_time_ns() - t0) / 1000)
    return sorted(times)[len(times) // 2]


def layer_costs(length: int) -> dict:
    """CPU microseconds of one SmolLM2-shaped layer's decode step parts: attention, and dequantization per format."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 3, length, 64, generator=g), torch.randn(1, 3, length, 64, generator=g)
    query = torch.randn(1, 9, 1, 64, generator=g)
    out_k, out_v = torch.empty_like(keys), torch.empty_like(values)
    costs = {
        "entries": length,
        "attention_us": round(_cpu_us(lambda: attend_padded(query, keys, values, None, 0.125)), 1),
    }
    for name in ("int8", "int4", "fp8"):
        fmt = KVQuant(name)
        kq, vq = quantize_keys(keys, fmt), quantize_values(values, fmt)

        def dequantize(fmt=fmt, kq=kq, vq=vq):
            dequantize_keys(*kq, fmt, torch.float32, out=out_k)
            dequantize_values(*vq, fmt, torch.float32, out=out_v)

        costs[f"dequantize_{name}_us"] = round(_cpu_us(dequantize), 1)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens (about)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens to decode per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per configuration (the fastest is reported)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="512-token prompt, 16 tokens, 1 run")
    parser.add_argument("--layer-only", action="store_true", help="only the per-layer dequantize/attention costs")
    parser.add_argument("--out", default="benchmarks/results/quantized_decode_smollm2_1k/quantized_decode.json")
    labels = [m[0] for m in METHODS + EXTRA_METHODS]
    parser.add_argument(
        "--methods", nargs="+", choices=labels, default=[m[0] for m in METHODS], help="configurations to run"
    )
    parser.add_argument(
        "--formats", nargs="+", default=list(FORMATS), help="entry formats: none and kv_quant specs (first: reference)"
    )
    args = parser.parse_args()
    formats = [None if f == "none" else f for f in args.formats]
    # resolved once, before the model loads: a bad spec fails here
    specs = {fmt: None if fmt is None else resolve_kv_quant(fmt).spec for fmt in formats}
    if args.quick:
        args.length, args.tokens, args.reps = 512, 16, 1
    torch.set_num_threads(args.threads)
    if args.layer_only:
        costs = layer_costs(args.length // 64 * 64)
        out = Path(args.out).with_name("layer_costs.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"threads": args.threads, **costs}, indent=2))
        print(json.dumps(costs))
        return
    model, tokenizer = kvtrim.load_model(MODEL)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = prompt_ids(tokenizer, args.length)
    n = int(ids.shape[1])
    fp16_bytes = cfg.num_hidden_layers * cfg.num_key_value_heads * n * head_dim * 2 * 2
    rows = []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ids, torch.ones_like(ids), get_method("snapkv").observation)
        for label, method, ratio, layout in (m for m in METHODS + EXTRA_METHODS if m[0] in args.methods):
            pipeline = None if method is None else get_method(method)
            if layout is not None:
                pipeline = dataclasses.replace(pipeline, layout=layout)
            spec = None if ratio is None else BudgetSpec(ratio=ratio)
            reference = None
            for fmt in formats:
                wall, cpu = [], []
                for _ in range(args.reps):
                    compressed = pre.compressed(pipeline, spec, fmt)
                    cache = compressed.cache
                    stats = cache.stats()
                    cpu0 = time.process_time()
                    outcome = greedy_decode(model, cache, pre.mask, pre.logits, args.tokens + 1, set(), -1)
                    cpu.append(1000 * (time.process_time() - cpu0) / outcome.steps)
                    wall.append(1000 * outcome.seconds / outcome.steps)
                tokens = outcome.tokens[0]
                reference = tokens if reference is None else reference
                row = {
                    "method": label,
                    "ratio": ratio,
                    "store": type(cache.layers[0].store).__name__,
                    "kv_quant": fmt or "none",
                    "kv_quant_spec": specs[fmt],
                    "entries": stats.entries,
                    "kv_bytes": stats.kv_bytes,
                    "bytes_per_entry": round(stats.kv_bytes / stats.entries, 1),
                    "fraction_of_fp16_full": round(stats.kv_bytes / fp16_bytes, 4),
                    "decode_steps": outcome.steps,
                    "decode_wall_ms_per_token": round(min(wall), 2),
                    "decode_cpu_ms_per_token": round(min(cpu), 2),
                    "wall_ms_all_reps": [round(x, 2) for x in wall],
                    "decoded_tokens": len(tokens),
                    "tokens_equal_to_unquantized": sum(a == b for a, b in zip(tokens, reference, strict=False)),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "threads": args.threads,
        "model": MODEL,
        "prompt_tokens": n,
        "decoded_tokens": args.tokens,
        "reps": args.reps,
        "fp16_full_cache_bytes": fp16_bytes,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    md = _markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)


def _markdown(result: dict) -> str:
    lines = [
        f"SmolLM2-135M, {result['prompt_tokens']}-token prompt, {result['decoded_tokens']} decoded tokens, "
        f"{result['threads']} thread(s), best of {result['reps']} runs; float16 full cache = "
        f"{result['fp16_full_cache_bytes']:,} B",
        "",
        "| method | kv_quant | store | entries | K/V bytes | B/entry | of fp16 full | decode ms/token (wall) | (cpu) "
        "| tokens = unquantized |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['method']} {r['ratio'] or ''} | {r['kv_quant']} | {r['store']} | {r['entries']:,} | "
            f"{r['kv_bytes']:,} | "
            f"{r['bytes_per_entry']} | {r['fraction_of_fp16_full']} | {r['decode_wall_ms_per_token']} | "
            f"{r['decode_cpu_ms_per_token']} | {r['tokens_equal_to_unquantized']}/{r['decoded_tokens']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
