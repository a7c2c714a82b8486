"""kvpress side of the kvtrim/kvpress comparison: what the cache holds after kvpress compresses a context.

Runs in the separate kvpress venv (``setup.sh``); imports nothing from kvtrim. Reads the prompts written by
``make_prompt.py`` and runs kvpress's own ``kv-press-text-generation`` pipeline (context-only: the context is
prefilled under the press, then the question is appended and answered greedily) with

* no press (the full cache),
* ``SnapKVPress`` and ``CriticalKVPress(SnapKVPress)``: uniform per-head budgets, which kvpress *prunes*
  (``keys.gather(...)``, new smaller tensors),
* ``AdaKVPress(SnapKVPress)`` and ``CriticalAdaKVPress(SnapKVPress)``: head-adaptive budgets, which kvpress
  *masks*: the full keys and values stay in the ``DynamicCache`` and the evicted (head, position) indices are
  stored in ``module.masked_key_indices``; at decoding time ``attention_patch.py`` overwrites those keys with a
  fake key whose attention weight underflows to zero.

All presses use kvpress's defaults (SnapKV ``window_size=64``, ``kernel_size=5``, average pooling; AdaKV
``alpha_safeguard=0.2``; CriticalKV ``epsilon=1e-4``, ``first_stage_ratio=0.5``).

The cache is measured at the moment the pipeline starts answering (after compression, before the question is
fed) by wrapping the pipeline's ``generate_answer``:

* ``kv_bytes``: sum of ``untyped_storage().nbytes()`` over every key and value tensor of the ``DynamicCache``;
* ``kv_entries_stored``: (token, layer, KV head) entries those tensors hold;
* ``kv_entries_masked``: entries listed in ``masked_key_indices`` (kvpress's "evicted" entries);
* ``kv_entries_effective``: stored minus masked, i.e. the entries attention can still see;
* ``index_bytes``: bytes of the ``masked_key_indices`` tensors (what masking adds on top of the cache).

Speeds are recorded but the machine is shared: do not read them as benchmarks.

Usage::

    benchmarks/peer_kvpress/.venv/bin/python benchmarks/peer_kvpress/run_kvpress.py \\
        --prompt benchmarks/results/peer_kvpress/prompt.json --out benchmarks/results/peer_kvpress/kvpress.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from importlib import metadata
from pathlib import Path

import kvpress
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PRESSES = ("snapkv", "critical_snapkv", "adakv", "critical_adakv")
# kvtrim registry name -> the kvpress press built for it (kvpress defaults everywhere)
PRESS_NAMES = {
    "full": "None (no press)",
    "snapkv": "SnapKVPress",
    "critical_snapkv": "CriticalKVPress(SnapKVPress)",
    "adakv": "AdaKVPress(SnapKVPress)",
    "critical_adakv": "CriticalAdaKVPress(SnapKVPress)",
}


def build_press(method: str, ratio: float):
    if method == "full":
        return None
    snap = kvpress.SnapKVPress(compression_ratio=ratio)
    if method == "snapkv":
        return snap
    if method == "critical_snapkv":
        return kvpress.CriticalKVPress(snap)
    if method == "adakv":
        return kvpress.AdaKVPress(snap)
    if method == "critical_adakv":
        return kvpress.CriticalAdaKVPress(snap)
    raise ValueError(f"unknown method {method!r}")


def press_settings(press) -> dict:
    if press is None:
        return {}
    inner = getattr(press, "press", press)
    out = {
        "press": type(press).__name__,
        "compression_ratio": press.compression_ratio,
        "window_size": inner.window_size,
        "kernel_size": inner.kernel_size,
        "pooling": "avg",
    }
    for name in ("alpha_safeguard", "epsilon", "first_stage_ratio"):
        if hasattr(press, name):
            out[name] = getattr(press, name)
    return out


def measure_cache(cache, model) -> dict:
    """Entries and bytes the DynamicCache holds right now, and what kvpress masks."""
    kv_bytes = stored = masked = index_bytes = 0
    per_layer_masked = []
    per_head_effective = []  # entries attention can see, per (layer, KV head), batch 0
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        kv_bytes += keys.untyped_storage().nbytes() + values.untyped_storage().nbytes()
        b, h, t, _ = keys.shape
        stored += b * h * t
        indices = getattr(model.model.layers[layer_idx].self_attn, "masked_key_indices", None)
        n = 0
        effective = torch.full((h,), t, dtype=torch.long)
        if indices is not None:
            n = int(indices[0].numel())
            index_bytes += sum(ix.untyped_storage().nbytes() for ix in indices)
            batch_idx, head_idx = indices[0], indices[1]
            effective -= torch.bincount(head_idx[batch_idx == 0].cpu(), minlength=h)
        per_head_effective.extend(effective.tolist())
        per_layer_masked.append(n)
        masked += n
    first = cache.layers[0].keys
    return {
        "kv_bytes": kv_bytes,
        "kv_entries_stored": stored,
        "kv_entries_masked": masked,
        "kv_entries_effective": stored - masked,
        "index_bytes": index_bytes,
        "seq_len_per_layer": sorted({int(layer.keys.shape[2]) for layer in cache.layers}),
        "masked_per_layer": per_layer_masked,
        "effective_per_head_min": min(per_head_effective),
        "effective_per_head_max": max(per_head_effective),
        "kv_dtype": str(first.dtype),
        "head_dim": int(first.shape[-1]),
        "kv_heads": int(first.shape[1]),
        "layers": len(cache.layers),
    }


def run_one(pipe, model, sample: dict, press) -> dict:
    """One pipeline call; the cache is measured when the pipeline starts answering."""
    captured: dict = {}
    original = pipe.generate_answer

    def generate_answer(question_ids, cache, context_length, max_new_tokens):
        captured["after"] = measure_cache(cache, model)
        captured["context_length"] = int(context_length)
        t0 = time.perf_counter()
        answer = original(
            question_ids=question_ids, cache=cache, context_length=context_length, max_new_tokens=max_new_tokens
        )
        captured["answer_s"] = time.perf_counter() - t0
        return answer

    pipe.generate_answer = generate_answer
    try:
        t0 = time.perf_counter()
        out = pipe(
            sample["context"],
            question=sample["kvpress_question"],
            answer_prefix=sample["answer_prefix"],
            press=press,
            max_new_tokens=sample["max_new_tokens"],
            max_context_length=10**9,
        )
        total_s = time.perf_counter() - t0
    finally:
        pipe.generate_answer = original
    return {"answer": out["answer"], "total_s": total_s, **captured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--methods", default=",".join(PRESSES))
    parser.add_argument("--samples", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    spec = json.loads(args.prompt.read_text())
    samples = spec["samples"][: args.samples] if args.samples else spec["samples"]
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = [m for m in args.methods.split(",") if m]

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"]).eval()
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)

    # The pipeline must build the very prompt kvtrim uses.
    identical = []
    for s in samples:
        pre = pipe.preprocess(
            s["context"], questions=[s["kvpress_question"]], answer_prefix=s["answer_prefix"], max_context_length=10**9
        )
        identical.append(
            pre["context_ids"][0].tolist() == s["kvtrim_context_ids"]
            and pre["questions_ids"][0][0].tolist() == s["kvtrim_question_ids"]
        )

    configs = [("full", None)] + [(m, r) for m in methods for r in ratios]
    records = []
    for method, ratio in configs:
        for s in samples:
            press = build_press(method, ratio)
            rec = run_one(pipe, model, s, press)
            rec.update(
                {
                    "library": "kvpress",
                    "method": method,
                    "press": PRESS_NAMES[method],
                    "ratio": ratio,
                    "settings": press_settings(press),
                    "sample": s["index"],
                    "answers": s["answers"],
                }
            )
            records.append(rec)
            a = rec["after"]
            print(
                f"kvpress {method:16s} ratio={ratio!s:5s} sample={s['index']} stored={a['kv_entries_stored']} "
                f"effective={a['kv_entries_effective']} bytes={a['kv_bytes']} answer={rec['answer']!r}",
                flush=True,
            )

    out = {
        "library": "kvpress",
        "versions": {
            "kvpress": metadata.version("kvpress"),
            "transformers": metadata.version("transformers"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "model_path": spec["model_path"],
        "model_dtype": str(model.dtype),
        "attn_implementation": model.config._attn_implementation,
        "threads": args.threads,
        "prompt_tokens_identical": identical,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
