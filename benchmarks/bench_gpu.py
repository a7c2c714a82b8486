"""kvtrim on an accelerator: prefill, compression, decode speed and memory per method, against HF's own cache.

The model is built from a named shape with random weights (nothing is downloaded):

* ``llama-8b``: Llama-3.1-8B (32 layers, hidden 4096, 32 query / 8 KV heads, intermediate 14336, vocab 128256);
* ``llama-1b``: Llama-3.2-1B (16 layers, hidden 2048, 32 query / 8 KV heads, intermediate 8192, vocab 128256);
* ``tiny``: 4 layers, hidden 256, 8 query / 2 KV heads (a smoke test, CPU friendly).

For every method, context length and batch size (random token ids, no padding) it records:

* ``prefill_s``: the prompt forward pass into the cache (kvtrim records what the method observes);
* ``compress_s``: scoring + budget + selection + compaction (kvtrim only);
* ``decode_ms``: one greedy step of the model forward alone (median of ``--steps`` timed steps after
  ``--decode-warmup`` untimed ones; the next token stays on the device, no host sync inside the loop);
* ``generate_decode_ms`` (with ``--generate``: two more prefills per configuration): a step inside
  ``model.generate`` (``(t(1 + N new tokens) - t(1 new token)) / N``, so prefill and compression cancel out);
* ``kv_bytes`` after prefill / after compression; ``peak_bytes``: on CUDA ``torch.cuda.max_memory_allocated``
  during prefill + compression and during decode, and those peaks above the memory held before the prefill
  (weights + inputs); on CPU, the largest K/V bytes held (kvtrim tracks it) and the process's max RSS.

``hf`` is transformers' ``DynamicCache`` with the model's default attention (``sdpa``: on CUDA PyTorch may pick
cuDNN); ``full`` is kvtrim's uncompressed cache with kvtrim attention (kvtrim's backend choice, see docs/gpu.md).
A method that fails is recorded with its error (``OOM`` for out-of-memory) and the run goes on.

The defaults (seven methods, contexts 4k and 32k, batches 1 and 8, prefill in 4096-token pieces, 16 timed steps,
no ``generate`` timing) are sized for one bounded device run: 28 configurations, 2.3 M prompt tokens of prefill
(docs/gpu-check.md gives the arithmetic). ``--methods all`` takes every method that needs no artifact.

Usage::

    python benchmarks/bench_gpu.py --shape llama-8b --device cuda --dtype bfloat16     # the defaults above
    python benchmarks/bench_gpu.py --device cpu --shape tiny --batches 1       # smoke run, about a minute

Writes ``<out>/bench_gpu_<shape>_<device>.json`` and ``.md`` (default ``benchmarks/results/bench_gpu/``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvtrim
from kvtrim.cache.sdpa import flash_attn_function, get_attention_backend, set_attention_backend
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.runtime import resolve_method

RESULTS = Path(__file__).resolve().parent / "results" / "bench_gpu"
HF, FULL = "hf", "full"
# Methods that need a calibrated artifact of the model (a random-weight model has none): recorded as errors.
ARTIFACT_METHODS = {
    "headkv", "critical_headkv", "compresskv", "compresskv_srh_only", "compresskv_trh", "head_compresskv",
    "ada_compresskv", "compilerkv", "compilerkv_elastic", "compilerkv_raw_attention", "compilerkv_static_threshold",
}  # fmt: skip

SHAPES = {
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    ),
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=32768,
    ),
}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The default method set: HF's cache, kvtrim's uncompressed cache, and one method per store and schedule kind
# (dense uniform, ragged per head, global across layers and heads, lag-relative, sink + recent window). Every
# method costs one prefill per (context, batch), so this list bounds the run (docs/gpu-check.md: the budget).
DEFAULT_METHODS = (HF, FULL, "snapkv", "adakv", "kvcompress", "lagkv", "streaming_llm")


def default_methods() -> list[str]:
    return list(DEFAULT_METHODS)


def all_methods() -> list[str]:
    """``hf``, ``full`` and every registry method that runs without a calibrated artifact."""
    return [HF, FULL, *[m for m in kvtrim.method_names() if m not in ARTIFACT_METHODS]]


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama of the named shape, built directly on ``device`` in ``dtype``."""
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def reset_peak(device: torch.device) -> int:
    """Reset the CUDA peak counter; returns the bytes allocated now (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def dynamic_kv_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def rss_bytes() -> int:
    """The process's max resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------- one config
def _cache_for(model, method: str, ratio: float):
    """``(cache, attention context or None)`` for ``method``; kvtrim caches do not compress on their own."""
    if method == HF:
        return DynamicCache(config=model.config), None
    layers = model.config.num_hidden_layers
    if method == FULL:
        return KVTrimCache(layers, auto_compress=False), kvtrim_attention_enabled(model)
    pipeline, spec = resolve_method(method, ratio, None, None, model)
    return KVTrimCache(layers, pipeline, spec, auto_compress=False), kvtrim_attention_enabled(model)


def _prefill(model, cache, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Feed the prompt (in ``chunk``-token pieces when given, each attending to the cache so far); returns the
    last position's logits ``[batch, vocab]``. Only the last position's logits are computed."""
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        piece = ids[:, start : start + step]
        pos = torch.arange(start, start + piece.shape[1], device=ids.device).expand(ids.shape[0], -1)
        out = model(input_ids=piece, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def _decode(model, cache, token, start: int, warmup: int, steps: int, device) -> float:
    """Median milliseconds per greedy step of the forward alone (positions continue from ``start``)."""
    b = token.shape[0]
    times = []
    for i in range(warmup + steps):
        pos = torch.full((b, 1), start + i, dtype=torch.long, device=device)
        t0 = clock(device) if i >= warmup else None
        out = model(input_ids=token, past_key_values=cache, position_ids=pos, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if t0 is not None:
            times.append(clock(device) - t0)
    return 1000 * statistics.median(times)


def _generate_step_ms(model, method: str, ratio: float, ids: torch.Tensor, steps: int, device) -> float:
    """Milliseconds per decode step inside ``model.generate`` (kvtrim: through ``kvtrim.compressing``)."""

    def run(new: int) -> float:
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        mask = torch.ones_like(ids)
        if method == HF:
            t0 = clock(device)
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            return clock(device) - t0
        params = {} if method == FULL else {"ratio": ratio}
        with kvtrim.compressing(model, method, **params) as cache:
            t0 = clock(device)
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
            return clock(device) - t0

    one = run(1)
    many = run(1 + steps)
    return 1000 * max(0.0, many - one) / steps


def run_config(model, method: str, context: int, batch: int, args, device) -> dict:
    """Measure one (method, context, batch); raises what the method raises (the caller records it)."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(context + batch))
    ids = ids.to(device)
    row: dict = {"method": method, "context": context, "batch": batch}
    base = reset_peak(device)
    row["bytes_before_prefill"] = base if device.type == "cuda" else None
    cache, attention = _cache_for(model, method, args.ratio)
    with torch.inference_mode():
        ctx = attention if attention is not None else _null()
        with ctx:
            t0 = clock(device)
            logits = _prefill(model, cache, ids, args.prefill_chunk)
            row["prefill_s"] = clock(device) - t0
            is_kvtrim = isinstance(cache, KVTrimCache)
            row["kv_bytes_prefill"] = cache.kv_nbytes() if is_kvtrim else dynamic_kv_bytes(cache)
            row["compress_s"] = None
            if is_kvtrim and cache.pipeline is not None:
                t0 = clock(device)
                report = cache.compress(logits=logits)
                row["compress_s"] = clock(device) - t0
                row["compress_share_of_prefill"] = row["compress_s"] / row["prefill_s"]
                row["entries_after"] = report.entries_after
                row["entries_before"] = report.entries_before
            row["kv_bytes_compressed"] = cache.kv_nbytes() if is_kvtrim else row["kv_bytes_prefill"]
            row["peak_prefill_compress_bytes"] = peak(device)
            reset_peak(device)
            token = logits.argmax(-1, keepdim=True)
            row["decode_ms"] = _decode(model, cache, token, context, args.decode_warmup, args.steps, device)
            row["peak_decode_bytes"] = peak(device)
            row["kv_bytes_after_decode"] = cache.kv_nbytes() if is_kvtrim else dynamic_kv_bytes(cache)
            if is_kvtrim:
                row["peak_kv_bytes"] = max(cache.peak_kv_bytes, row["kv_bytes_prefill"])
    if device.type == "cuda":
        for key in ("peak_prefill_compress_bytes", "peak_decode_bytes"):
            row[key.replace("_bytes", "_above_base_bytes")] = row[key] - base
    else:
        row["rss_max_bytes"] = rss_bytes()
    del cache, logits, token
    free(device)
    if args.generate:
        with torch.inference_mode():
            row["generate_decode_ms"] = _generate_step_ms(model, method, args.ratio, ids, args.steps, device)
        free(device)
    return row


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def guarded(model, method: str, context: int, batch: int, args, device) -> dict:
    """``run_config`` with failures recorded instead of raised (``OOM`` for out-of-memory)."""
    try:
        return {"status": "ok", **run_config(model, method, context, batch, args, device)}
    except torch.OutOfMemoryError as exc:
        status, message = "OOM", str(exc).splitlines()[0][:300]
    except Exception as exc:  # recorded, the run goes on
        status = "error"
        message = f"{type(exc).__name__}: {str(exc)[:300]}"
        tb = traceback.extract_tb(exc.__traceback__)[-3:]
        message += " @ " + " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb))
    free(device)
    return {"status": status, "error": message, "method": method, "context": context, "batch": batch}


# ---------------------------------------------------------------------------------------------------- report
def _fmt(v, scale=1.0, digits=1):
    return "" if v is None else f"{v * scale:.{digits}f}"


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# bench_gpu: {meta['shape']} on {meta['device_name']} ({meta['dtype']}, ratio {meta['ratio']})",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, kvtrim attention backend "
        f"`{meta['attention_backend']}` (flash-attn importable: {meta['flash_attn']}), HF default attention "
        f"`{meta['hf_attention']}`; {meta['steps']} timed decode steps after {meta['decode_warmup']} warmup. "
        f"{meta['note']}",
        "",
        "| method | context | batch | prefill s | compress s | compress/prefill | decode ms | in generate ms | "
        "vs kvtrim full | K/V MiB prefill | K/V MiB kept | peak MiB prefill+compress | peak MiB decode | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    full = {(r["context"], r["batch"]): r.get("decode_ms") for r in result["rows"] if r["method"] == FULL}
    mib = 1 / 2**20
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(
                f"| {r['method']} | {r['context']} | {r['batch']} |  |  |  |  |  |  |  |  |  |  | "
                f"{r['status']}: {r['error'][:120].replace('|', '/')} |"
            )
            continue
        ref = full.get((r["context"], r["batch"]))
        ratio = f"{r['decode_ms'] / ref:.2f}x" if ref else ""
        cuda = r.get("peak_prefill_compress_above_base_bytes") is not None
        pk1 = r.get("peak_prefill_compress_above_base_bytes") if cuda else r.get("peak_kv_bytes")
        pk2 = r.get("peak_decode_above_base_bytes") if cuda else r.get("kv_bytes_after_decode")
        lines.append(
            f"| {r['method']} | {r['context']} | {r['batch']} | {_fmt(r['prefill_s'], 1, 3)} | "
            f"{_fmt(r['compress_s'], 1, 3)} | {_fmt(r.get('compress_share_of_prefill'), 100, 1)}"
            f"{'%' if r.get('compress_share_of_prefill') is not None else ''} | {_fmt(r['decode_ms'], 1, 2)} | "
            f"{_fmt(r.get('generate_decode_ms'), 1, 2)} | {ratio} | {_fmt(r['kv_bytes_prefill'], mib)} | "
            f"{_fmt(r['kv_bytes_compressed'], mib)} | {_fmt(pk1, mib)} | {_fmt(pk2, mib)} | ok |"
        )
    lines += [
        "",
        "Peaks: on CUDA, `torch.cuda.max_memory_allocated` above what was allocated before the prefill (weights, "
        "inputs); on CPU, the largest K/V bytes the cache held (prefill+compress column) and the K/V bytes after "
        "decoding (decode column); the process max RSS is in the JSON. `vs kvtrim full`: decode ms over kvtrim's "
        "own uncompressed cache at the same context and batch.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--methods", default=None, help=f"comma list (default: {','.join(DEFAULT_METHODS)}; 'all': "
                   "every method without an artifact); 'hf' = transformers DynamicCache")  # fmt: skip
    p.add_argument("--contexts", type=_ints, default=None, help="comma list (default 4096,32768; tiny: 512,1024)")
    p.add_argument("--batches", type=_ints, default=[1, 8])
    p.add_argument("--ratio", type=float, default=0.875)
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16; tiny 8)")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--attention-backend", default=None, help="kvtrim.set_attention_backend value (default: auto)")
    p.add_argument("--prefill-chunk", type=int, default=4096,
                   help="prefill this many tokens per forward pass (default 4096: at batch 8 x 32k one pass would "
                   "hold the MLP activations of the whole prompt); kvtrim compresses after the last chunk")  # fmt: skip
    p.add_argument("--generate", action="store_true",
                   help="also time a step inside model.generate (two more prefills per configuration)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", default="", help="free text stored with the results (e.g. 'machine shared')")
    args = p.parse_args(argv)
    if not 0.0 <= args.ratio < 1.0:
        p.error(f"--ratio must be in [0, 1), got {args.ratio}")
    tiny = args.shape == "tiny"
    args.contexts = args.contexts or ([512, 1024] if tiny else [4096, 32768])
    args.steps = args.steps or (8 if tiny else 16)
    if args.steps <= 0 or args.decode_warmup < 0:
        p.error("--steps must be positive and --decode-warmup >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        p.error(f"--prefill-chunk must be positive, got {args.prefill_chunk}")
    known = set(kvtrim.method_names()) | {HF, FULL}
    if args.methods == "all":
        args.methods = all_methods()
    else:
        args.methods = [m.strip() for m in args.methods.split(",")] if args.methods else default_methods()
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {sorted(known)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.attention_backend is not None:
        set_attention_backend(args.attention_backend)
    model = build_model(args.shape, device, dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {
        "shape": args.shape,
        "config": SHAPES[args.shape],
        "device": str(device),
        "device_name": device_name,
        "dtype": str(dtype).replace("torch.", ""),
        "ratio": args.ratio,
        "steps": args.steps,
        "decode_warmup": args.decode_warmup,
        "prefill_chunk": args.prefill_chunk,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "attention_backend": get_attention_backend(),
        "flash_attn": flash_attn_function() is not None,
        "hf_attention": model.config._attn_implementation,
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "note": args.note,
    }
    # Warm up every method once on a short prompt (kernel selection, allocator, lazy imports) before measuring.
    warm = min(256, min(args.contexts))
    for method in args.methods:
        guarded(model, method, warm, 1, argparse.Namespace(**{**vars(args), "steps": 1, "decode_warmup": 1,
                                                               "generate": False}), device)  # fmt: skip
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            for method in args.methods:
                row = guarded(model, method, context, batch, args, device)
                rows.append(row)
                shown = row.get("decode_ms", row.get("error", ""))
                print(f"{method:>24} ctx={context:<6} b={batch:<3} {row['status']:>5} {shown}", flush=True)
    result = {"meta": meta, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_gpu_{args.shape}_{device.type}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
