"""Chunked prefill with compression between chunks: peak memory and first-token agreement (SmolLM2-135M, CPU).

Part 1, peak memory (long prompts, 4k and 8k tokens; each configuration in a fresh subprocess):

* ``full``: one forward pass over the whole prompt, nothing evicted;
* ``full_chunked``: the same prompt fed ``--chunk`` tokens at a time, nothing evicted;
* ``lagkv_chunked``: LagKV at 4x (ratio 0.75), compressing whenever its tail reaches two partitions;
* ``snapkv_chunked`` / ``streaming_llm_chunked``: compressed to a fixed budget after every chunk.

Reported: the largest key/value bytes the cache held at any chunk boundary (``peak_kv_bytes``, measured from
the tensors), the process's peak resident memory (``VmHWM``) minus its resident memory after loading the
model and paging all its weights in, prefill CPU seconds, and whether the first generated token equals the one
of ``full``.

Part 2, first-token agreement (the LagKV paper's check of its chunked prefill): on ~1k-token harness prompts,
question included in the prefill, the share of prompts whose first generated token under chunked prefill with
compression equals the token of the uncompressed one-pass prefill (a one-pass prefill always agrees: it
compresses only after the prompt's last position is computed).

Usage::

    python benchmarks/bench_chunked_prefill.py                 # ~20 min of CPU time
    python benchmarks/bench_chunked_prefill.py --quick         # smoke run

Writes ``--out`` (JSON, default ``benchmarks/results/bench_chunked_prefill/chunked_prefill.json``) and a markdown
table next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m"
CONFIGS = {
    "full": (None, None, None, False),
    "full_chunked": (None, None, None, True),
    "lagkv_chunked": ("lagkv", 0.75, None, True),
    "snapkv_chunked": ("snapkv", None, 1024, True),
    "streaming_llm_chunked": ("streaming_llm", None, 1024, True),
}


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prompt_ids(tokenizer, length: int, task: str = "niah_single_2", index: int = 0):
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template

    sample = generate_task(task, tokenizer, length, index + 1, seed=7)[index]
    template = prompt_template(tokenizer, bool(sample.meta.get("chat_template", True)))
    text = template.context_part(sample.context) + template.question_part(sample.question, sample.answer_prefix)
    special = template.prefix == ""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"]
    return ids


def _prefill(model, ids, config: str, chunk: int):
    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill
    from kvtrim.scoring.observation import ObservationSpec

    method, ratio, budget, chunked = CONFIGS[config]
    mask = torch.ones_like(ids)
    pipeline = get_method(method) if method else None
    spec = BudgetSpec(ratio=ratio, budget=budget) if method else None
    if chunked:
        pre = Prefill.chunked(model, ids, mask, chunk, pipeline, spec)
        if pipeline is not None:
            pre.cache.compress()  # the final compression, as after a one-pass prefill
    else:
        pre = Prefill.plain(model, ids, mask, ObservationSpec())
        pre.cache.peak_kv_bytes = pre.cache.stats().kv_bytes
    return pre


def worker(length: int, config: str, chunk: int, threads: int) -> dict:
    import kvtrim
    from kvtrim.integration.attention import kvtrim_attention_enabled

    torch.set_num_threads(threads)
    model, tokenizer = kvtrim.load_model(MODEL)
    ids = _prompt_ids(tokenizer, length)
    with torch.inference_mode():  # page the (memory-mapped) weights in, so the baseline holds them
        for p in model.parameters():
            p.sum()
    rss_loaded = _status("VmRSS")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = _prefill(model, ids, config, chunk)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "length": length,
        "tokens": int(ids.shape[1]),
        "config": config,
        "chunk": chunk if CONFIGS[config][3] else None,
        "peak_kv_bytes": int(max(pre.cache.peak_kv_bytes, pre.cache.stats().kv_bytes)),
        "final_kv_bytes": int(pre.cache.stats().kv_bytes),
        "compressions": int(pre.cache.compressions),
        "rss_loaded_bytes": rss_loaded,
        "rss_peak_bytes": _status("VmHWM"),
        "rss_peak_over_loaded_bytes": _status("VmHWM") - rss_loaded,
        "prefill_cpu_s": round(cpu, 2),
        "prefill_wall_s": round(wall, 2),
        "first_token": int(pre.logits[0].argmax()),
    }


def agreement(samples: int, chunk: int, threads: int) -> list[dict]:
    """First-token agreement on ~1k-token prompts (question included), several tasks."""
    import kvtrim
    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill
    from kvtrim.scoring.observation import ObservationSpec

    torch.set_num_threads(threads)
    model, tokenizer = kvtrim.load_model(MODEL)
    setups = [("lagkv", 0.5), ("lagkv", 0.75), ("lagkv", 0.875), ("snapkv", 0.75), ("streaming_llm", 0.75)]
    rows = {s: {"method": s[0], "ratio": s[1], "chunked_agree": 0, "n": 0} for s in setups}
    tasks = ("passkey", "niah_single_2", "niah_multikey_1", "vt", "fwe")
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        for task in tasks:
            for index in range(samples):
                ids = _prompt_ids(tokenizer, 1024, task, index)
                mask = torch.ones_like(ids)
                full = Prefill.plain(model, ids, mask, ObservationSpec())
                reference = int(full.logits[0].argmax())
                for method, ratio in setups:
                    chunked = Prefill.chunked(model, ids, mask, chunk, get_method(method), BudgetSpec(ratio=ratio))
                    row = rows[(method, ratio)]
                    row["n"] += 1
                    row["chunked_agree"] += int(int(chunked.logits[0].argmax()) == reference)
    out = []
    for row in rows.values():
        row["chunked_agree_pct"] = round(100 * row["chunked_agree"] / row["n"], 1)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--agreement-chunk", type=int, default=128)
    parser.add_argument("--agreement-samples", type=int, default=4, help="prompts per task for part 2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/bench_chunked_prefill/chunked_prefill.json")
    parser.add_argument("--worker", nargs=2, metavar=("LENGTH", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args.chunk, args.threads)))
        return
    lengths = [1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    memory = []
    for length in lengths:
        for config in CONFIGS:
            cmd = [sys.executable, __file__, "--worker", str(length), config, "--chunk", str(args.chunk)]
            cmd += ["--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
            row = json.loads(done.stdout.strip().splitlines()[-1])
            memory.append(row)
            print(json.dumps(row), flush=True)
    for row in memory:
        ref = next(r for r in memory if r["length"] == row["length"] and r["config"] == "full")
        row["first_token_equals_full"] = row["first_token"] == ref["first_token"]
    agree = agreement(1 if args.quick else args.agreement_samples, args.agreement_chunk, args.threads)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "threads": args.threads,
        "chunk": args.chunk,
        "memory": memory,
        "agreement_chunk": args.agreement_chunk,
        "agreement": agree,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    md = _markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)


def _markdown(result: dict) -> str:
    mib = 2**20
    lines = [
        "# Chunked prefill: peak memory and first-token agreement (SmolLM2-135M, CPU)",
        "",
        f"Run {result['date']}, {result['threads']} torch thread(s), chunk {result['chunk']} tokens. "
        "Peak K/V = the largest key/value bytes held at a chunk boundary (from the tensors); peak RSS over "
        "loaded = the process's resident high-water mark minus its resident size after loading the model and "
        "paging its weights in.",
        "",
        "| prompt tokens | config | peak K/V MiB | final K/V MiB | peak RSS over loaded MiB | compressions "
        "| prefill CPU s | first token = full |",
        "|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["memory"]:
        lines.append(
            f"| {r['tokens']} | {r['config']} | {r['peak_kv_bytes'] / mib:.1f} | {r['final_kv_bytes'] / mib:.1f} "
            f"| {r['rss_peak_over_loaded_bytes'] / mib:.0f} | {r['compressions']} | {r['prefill_cpu_s']:.1f} "
            f"| {'yes' if r['first_token_equals_full'] else 'no'} |"
        )
    lines += [
        "",
        f"First generated token, chunked prefill (chunk {result['agreement_chunk']}) with compression between "
        "chunks vs. one uncompressed pass, ~1k-token prompts with the question (passkey, niah_single_2, "
        "niah_multikey_1, vt, fwe):",
        "",
        "| method | ratio | prompts | first token agrees |",
        "|---|---:|---:|---:|",
    ]
    for r in result["agreement"]:
        lines.append(f"| {r['method']} | {r['ratio']} | {r['n']} | {r['chunked_agree_pct']:.1f} % |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
