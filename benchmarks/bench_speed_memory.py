"""Speed and memory of kvtrim on the embedded SmolLM2-135M model (CPU).

Measures, on prompts of 1k, 2k and 4k tokens:

* prefill time with the plain uncompressed cache (kvtrim's ``KVTrimCache`` without a method, i.e.
  ``method="full"``), with transformers' own ``DynamicCache`` and the model's default (sdpa) attention as a
  reference, and with each compression method (prefill includes recording the observations the method needs);
  compression time (scoring + budget allocation + selection + compaction) is timed separately;
* at 4k tokens, decode milliseconds per token over a fixed number of greedily generated tokens with the full
  cache, with SnapKV and StreamingLLM at 2x, 4x and 8x compression, and with the transformers baseline;
* bytes of the key/value tensors held after prefill, after compression and after decoding, checked against
  ``entries x 2 (K and V) x head_dim x bytes per element``.

Every timed configuration is run round-robin (one repetition of every configuration, then the next
repetition), and the median is reported, so slow drifts of the machine spread over all configurations.

Usage::

    python benchmarks/bench_speed_memory.py             # full run (~15 min of CPU time)
    python benchmarks/bench_speed_memory.py --threads 1 --timer cpu   # on a machine busy with other work
    python benchmarks/bench_speed_memory.py --quick     # smoke run (short prompts, 1 repetition)

Results go to ``--out`` (JSON, default ``benchmarks/results/bench_speed_memory/speed_memory.json``) and a markdown
table next to it (same name, ``.md``), which is also printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import kvtrim
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.scoring.observation import ObservationSpec

MODEL = "smollm2-135m"
PREFILL_METHODS = ("snapkv", "pyramidkv", "h2o", "streaming_llm", "knorm", "tova")
PREFILL_RATIO = 0.5
DECODE_METHODS = ("snapkv", "streaming_llm")
DECODE_RATIOS = (0.5, 0.75, 0.875)  # 2x, 4x, 8x fewer entries
HF = "hf_dynamic_cache"  # transformers DynamicCache + the model's default attention (sdpa)
FULL = "full"  # kvtrim cache, kvtrim attention, no compression

# Varied English prose (written for this benchmark), cycled until the prompt is long enough.
PARAGRAPHS = (
    "The harbour town of Westmere wakes before the sun. Fishing boats slip out past the breakwater while the "
    "bakery on Quay Street fires its ovens, and by six o'clock the smell of bread has reached the lighthouse. "
    "Most residents can name every boat by the colour of its hull, and they notice at once when one is missing.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of a leaf, chlorophyll absorbs "
    "mostly red and blue light, splitting water molecules and releasing oxygen as a by-product. The energy "
    "captured is stored in sugars, which the plant uses to grow roots, stems and seeds.",
    "In 1869 the first transcontinental railroad in the United States was completed at Promontory Summit, Utah. "
    "A ceremonial golden spike was driven into the final tie, and telegraph operators sent the single word "
    '"done" to cities across the country. A journey that once took months could now be made in about a week.',
    "To make a simple tomato sauce, warm a little olive oil in a wide pan and soften a chopped onion for ten "
    "minutes. Add two cloves of garlic, then a tin of tomatoes and a pinch of salt. Let it simmer gently for "
    "twenty minutes, stirring now and then, and finish it with a handful of torn basil leaves.",
    "Margaret kept a notebook of every bird she saw from her kitchen window. Over eleven winters she recorded "
    "forty-three species, from the common sparrow to a single waxwing that stayed for two days in January. Her "
    "grandson later typed the entries into a spreadsheet and found that the robins always arrived first.",
    "A binary search finds an item in a sorted list by repeatedly halving the range that could contain it. "
    "Compare the target with the middle element; if it is smaller, continue in the left half, otherwise in the "
    "right half. Because the range halves at each step, a list of a million items needs only about twenty steps.",
    "The committee met on Tuesday to discuss the new library. After a long debate about parking, the members "
    "agreed that the building should face the park, that the children's section needed its own entrance, and "
    "that the reading room would stay open until nine in the evening during the examination season.",
    "Glaciers move slowly under their own weight, grinding the rock beneath them into fine powder. When the ice "
    "retreats it leaves behind long ridges of gravel called moraines and lakes of milky blue water. Many valleys "
    "in the Alps owe their broad U-shaped profile to glaciers that melted thousands of years ago.",
    "On the night of the storm, the ferry to the island was cancelled and forty passengers waited in the station "
    "café. A student played the piano, a retired teacher organised a quiz, and by midnight strangers were "
    "sharing sandwiches and telephone numbers. The ferry finally left at dawn, under a clear and quiet sky.",
)
QUESTION = (
    "\n\nQuestion: Write a long, detailed summary of everything described above, paragraph by paragraph.\nAnswer:"
)


# ------------------------------------------------------------------------------------------------ helpers
TIMERS = {
    "wall": time.perf_counter,  # elapsed time
    "cpu": time.process_time,  # CPU time of this process (all threads): robust to other processes with --threads 1
}
_timer = {"name": "wall"}


def clock() -> float:
    return TIMERS[_timer["name"]]()


def build_prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    """``[1, n_tokens]`` token ids: cycled paragraphs cut at a token boundary, then the question."""
    q_ids = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    n_par = len(PARAGRAPHS)
    while True:
        body_ids = tokenizer("\n\n".join(PARAGRAPHS[j % len(PARAGRAPHS)] for j in range(n_par)))["input_ids"]
        if len(body_ids) >= n_tokens:
            break
        n_par *= 2
    ids = body_ids[: n_tokens - len(q_ids)] + q_ids
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return torch.tensor([ids], dtype=torch.long)


def hf_kv_bytes(cache: DynamicCache) -> tuple[int, int]:
    """(bytes, tokens) of the key/value tensors of a transformers DynamicCache."""
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return total, int(cache.get_seq_length())


def theoretical_bytes(entries: int, head_dim: int, itemsize: int) -> int:
    """``entries`` (token, layer, KV head) slots of K and V."""
    return entries * 2 * head_dim * itemsize


def fresh_gc() -> None:
    gc.collect()


def timed_forward(model, ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None):
    """One forward pass feeding ``ids`` into ``cache``; returns (seconds, last logits)."""
    t0 = clock()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=position_ids, logits_to_keep=1)
    return clock() - t0, out.logits[:, -1]


def hf_prefill(model, ids: torch.Tensor):
    """Prefill with transformers' DynamicCache and the model's default attention."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        seconds, logits = timed_forward(model, ids, cache)
    return seconds, cache, logits


def kvtrim_prefill(model, ids: torch.Tensor, method: str | None, ratio: float | None, observe: tuple[str, ...] = ()):
    """Prefill a KVTrimCache recording what ``method`` needs; ``method=None`` is the uncompressed cache.

    ``observe``: with ``method=None``, record the union of what these methods need (as ``kvtrim.Session``
    does), so that copies of the cache can be compressed with any of them.
    """
    n_layers = model.config.num_hidden_layers
    if method is None:
        cache = kvtrim.KVTrimCache(n_layers, auto_compress=False)
        if observe:
            spec = ObservationSpec()
            for m in observe:
                spec = spec.merge(kvtrim.get_method(m).observation)
            cache.observing = bool(spec.window or spec.accumulate)
            cache.observation_spec = spec
    else:
        cache = kvtrim.KVTrimCache(
            n_layers, kvtrim.get_method(method), kvtrim.BudgetSpec(ratio=ratio), auto_compress=False
        )
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        seconds, logits = timed_forward(model, ids, cache)
    cache.observing = False
    return seconds, cache, logits


def compress(model, cache, logits) -> float:
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        t0 = clock()
        cache.compress(logits=logits)
        return clock() - t0


def decode_steps(model, cache, logits, start: int, n_steps: int, kvtrim_path: bool) -> list[float]:
    """Greedy single-token forwards (EOS ignored, so the count is fixed); returns seconds per step.

    Positions continue from the original prompt length ``start`` (the cache may hold fewer entries).
    """
    times = []
    token = logits.argmax(-1, keepdim=True)
    ctx = kvtrim_attention_enabled(model) if kvtrim_path else nullcontext()
    with torch.inference_mode(), ctx:
        for i in range(n_steps):
            seconds, step_logits = timed_forward(model, token, cache, torch.tensor([[start + i]]))
            token = step_logits.argmax(-1, keepdim=True)
            times.append(seconds)
    return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str | None:
    """Short commit hash, with ``+dirty`` when ``src/`` has uncommitted changes."""
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent.parent,
        ).stdout.strip()
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        return (out.stdout.strip() + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(model) -> dict:
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvtrim": kvtrim.__version__,
        "git_revision": git_revision(),
        "torch_threads": torch.get_num_threads(),
        "timer": _timer["name"],
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "model": MODEL,
        "model_dtype": str(model.dtype),
        "model_default_attention": model.config._attn_implementation,
        "num_layers": model.config.num_hidden_layers,
        "num_attention_heads": model.config.num_attention_heads,
        "num_key_value_heads": model.config.num_key_value_heads,
        "head_dim": head_dim_of(model),
        "load_average_start": list(os.getloadavg()),
        "methods": {
            m: {"params": kvtrim.get_method(m).params, "layout": getattr(kvtrim.get_method(m), "layout", None)}
            for m in dict.fromkeys(PREFILL_METHODS + DECODE_METHODS)
        },
    }


def head_dim_of(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


class CpuMonitor:
    """CPU time used by *other* processes while a measurement runs, from ``/proc/stat`` (contention check).

    ``others_share`` is the fraction of the machine's total CPU capacity (all cores) that other processes used;
    near 0 means the measurement had the machine to itself.
    """

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, float]:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
            busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
        except (OSError, ValueError, IndexError):
            busy = float("nan")
        t = os.times()
        return busy, t.user + t.system, time.perf_counter(), 0.0

    def result(self) -> dict:
        busy, own, now, _ = self._read()
        elapsed = max(now - self.start[2], 1e-9)
        others = max(0.0, (busy - self.start[0]) - (own - self.start[1]))
        return {
            "wall_s": elapsed,
            "own_cpu_s": own - self.start[1],
            "others_cpu_s": others,
            "others_share": others / (elapsed * (os.cpu_count() or 1)),
        }


class IdleWaiter:
    """Waits (within a total time budget) until other processes leave the CPU mostly idle."""

    def __init__(self, budget_s: float, threshold: float = 0.10, probe_s: float = 5.0) -> None:
        self.budget_s, self.threshold, self.probe_s = budget_s, threshold, probe_s
        self.waited_s = 0.0
        self.log: list[dict] = []

    def wait(self, label: str) -> None:
        if self.budget_s <= 0:
            return
        while True:
            monitor = CpuMonitor()
            time.sleep(self.probe_s)
            share = monitor.result()["others_share"]
            if share < self.threshold or self.waited_s >= self.budget_s:
                self.log.append({"before": label, "others_share": share, "waited_s_total": self.waited_s})
                if share >= self.threshold:
                    log(f"  {label}: other processes still use {share:.0%} of the CPU; measuring anyway")
                return
            log(f"  {label}: other processes use {share:.0%} of the CPU; waiting")
            self.waited_s += self.probe_s


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ prefill
def prefill_sample(model, ids: torch.Tensor, config: str, checks: list, label: str) -> dict:
    """One prefill (and compression, for a method) of ``ids`` with ``config``; sizes and timings."""
    head_dim, itemsize = head_dim_of(model), model.dtype.itemsize
    fresh_gc()
    monitor = CpuMonitor()
    if config == HF:
        seconds, cache, _ = hf_prefill(model, ids)
        load = monitor.result()
        kv, tokens = hf_kv_bytes(cache)
        info = {"kv_bytes_after_prefill": kv, "seen_tokens": tokens}
        return {"prefill_s": seconds, "compress_s": None, "share": load["others_share"], "load": load, "info": info}
    method = None if config == FULL else config
    seconds, cache, logits = kvtrim_prefill(model, ids, method, PREFILL_RATIO)
    before = cache.stats()
    theo = theoretical_bytes(before.entries, head_dim, itemsize)
    checks.append((f"{label} after prefill", before.kv_bytes, theo))
    info = {
        "entries_after_prefill": before.entries,
        "kv_bytes_after_prefill": before.kv_bytes,
        "kv_bytes_theoretical_after_prefill": theo,
        "index_bytes_after_prefill": before.index_bytes,
        "seen_tokens": before.seen_tokens,
    }
    c_s = None
    if method is not None:
        c_s = compress(model, cache, logits)
        after = cache.stats()
        theo = theoretical_bytes(after.entries, head_dim, itemsize)
        checks.append((f"{label} after compress", after.kv_bytes, theo))
        info.update(
            entries_after_compress=after.entries,
            kv_bytes_after_compress=after.kv_bytes,
            kv_bytes_theoretical_after_compress=theo,
            index_bytes_after_compress=after.index_bytes,
            kept_fraction=after.entries / before.entries,
        )
    load = monitor.result()
    return {"prefill_s": seconds, "compress_s": c_s, "share": load["others_share"], "load": load, "info": info}


def least_contended(run, retries: int, waiter: IdleWaiter, label: str) -> tuple[dict, int]:
    """Run ``run()``; while other processes used twice the waiter's threshold or more of the CPU during it, wait
    for the machine to quieten and run it again (up to ``retries`` times); keep the least contended attempt.
    Returns (result, attempts)."""
    threshold = 2 * waiter.threshold
    best, attempts = None, 0
    for attempt in range(retries + 1):
        attempts += 1
        result = run()
        if best is None or result["share"] < best["share"]:
            best = result
        if result["share"] < threshold:
            break
        if attempt < retries:
            log(f"  {label}: other processes used {result['share']:.0%} of the CPU; measuring again")
            waiter.wait(label)
    return best, attempts


def bench_prefill(
    model, tokenizer, lengths, methods, reps_for, checks: list, waiter: IdleWaiter, retries: int
) -> list[dict]:
    rows = []
    for length in lengths:
        ids = build_prompt(tokenizer, length)
        configs = [HF, FULL, *methods]
        samples: dict[str, dict[str, list]] = {
            c: {"prefill_s": [], "compress_s": [], "others_share": [], "attempts": [], "load": []} for c in configs
        }
        sizes: dict[str, dict] = {}
        reps = reps_for(length)
        waiter.wait(f"prefill {length}")
        for rep in range(reps):
            for config in configs:
                label = f"prefill {length} {config} rep {rep + 1}"
                s, attempts = least_contended(
                    functools.partial(prefill_sample, model, ids, config, checks, label),
                    retries,
                    waiter,
                    label,
                )
                for key, value in (("prefill_s", s["prefill_s"]), ("compress_s", s["compress_s"])):
                    if value is not None:
                        samples[config][key].append(value)
                samples[config]["others_share"].append(s["share"])
                samples[config]["load"].append(s["load"])
                samples[config]["attempts"].append(attempts)
                sizes[config] = s["info"]
                msg = f"  prefill {length:5d} rep {rep + 1}/{reps} {config:16s} {s['prefill_s']:7.3f}s"
                if s["compress_s"] is not None:
                    msg += f"  compress {s['compress_s']:7.3f}s"
                    msg += f"  kept {s['info']['entries_after_compress']}/{s['info']['entries_after_prefill']}"
                log(msg + f"  others {s['share']:.0%}")
        hf_med = median(samples[HF]["prefill_s"])
        full_med = median(samples[FULL]["prefill_s"])
        for config in configs:
            p = samples[config]["prefill_s"]
            c = samples[config]["compress_s"]
            p_med = median(p)
            c_med = median(c) if c else 0.0
            row = {
                "context_tokens": length,
                "config": config,
                "ratio": PREFILL_RATIO if config not in (HF, FULL) else None,
                "repetitions": len(p),
                "prefill_s_median": p_med,
                "prefill_s_samples": p,
                "compress_s_median": c_med if c else None,
                "compress_s_samples": c,
                "others_cpu_share_samples": samples[config]["others_share"],
                "attempts_per_sample": samples[config]["attempts"],
                "load_per_sample": samples[config]["load"],
                "prefill_plus_compress_s": p_med + c_med,
                "prefill_tokens_per_s": length / p_med,
                "overhead_vs_full_pct": 100.0 * ((p_med + c_med) / full_med - 1.0),
                "overhead_vs_hf_pct": 100.0 * ((p_med + c_med) / hf_med - 1.0),
                **sizes[config],
            }
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ decode
def decode_sample(model, master, logits, hf_cache, hf_logits, config, length, warmup, n_tokens, checks) -> dict:
    """Decode ``warmup + n_tokens`` tokens from a fresh copy of the prefilled cache, compressed per ``config``."""
    head_dim, itemsize = head_dim_of(model), model.dtype.itemsize
    name, ratio = config
    fresh_gc()
    monitor = CpuMonitor()
    if name == HF:
        kv_before, _ = hf_kv_bytes(hf_cache)
        times = decode_steps(model, hf_cache, hf_logits, length, warmup + n_tokens, kvtrim_path=False)
        kv_after, _ = hf_kv_bytes(hf_cache)
        hf_cache.crop(-(warmup + n_tokens))
        assert hf_cache.get_seq_length() == length
        info = {"kv_bytes_after_prefill": kv_before, "kv_bytes_after_decode": kv_after}
        c_s = None
    else:
        if name == FULL:
            cache, c_s = master.clone(None, None), None
        else:
            cache = master.clone(kvtrim.get_method(name), kvtrim.BudgetSpec(ratio=ratio))
            c_s = compress(model, cache, logits)
        st = cache.stats()
        theo = theoretical_bytes(st.entries, head_dim, itemsize)
        checks.append((f"decode {name} ratio={ratio} before decode", st.kv_bytes, theo))
        times = decode_steps(model, cache, logits, length, warmup + n_tokens, kvtrim_path=True)
        end = cache.stats()
        info = {
            "entries_after_compress": st.entries,
            "kv_bytes_after_compress": st.kv_bytes,
            "kv_bytes_theoretical_after_compress": theo,
            "index_bytes_after_compress": st.index_bytes,
            "entries_after_decode": end.entries,
            "kv_bytes_after_decode": end.kv_bytes,
            "kv_bytes_theoretical_after_decode": theoretical_bytes(end.entries, head_dim, itemsize),
            "index_bytes_after_decode": end.index_bytes,
        }
    load = monitor.result()
    return {"times": times, "compress_s": c_s, "info": info, "share": load["others_share"], "load": load}


def bench_decode(
    model, tokenizer, length, methods, ratios, warmup, n_tokens, reps, checks: list, waiter: IdleWaiter, retries: int
) -> dict:
    ids = build_prompt(tokenizer, length)
    log(f"  decode: prefilling {length} tokens (HF and kvtrim, once each)")
    _, hf_cache, hf_logits = hf_prefill(model, ids)
    # One kvtrim prefill recording the union of what the methods need; each configuration compresses a copy.
    _, master, logits = kvtrim_prefill(model, ids, None, None, observe=tuple(methods))
    configs = [(HF, None), (FULL, None)] + [(m, r) for m in methods for r in ratios]
    samples: dict[tuple, list[float]] = {c: [] for c in configs}
    step_samples: dict[tuple, list[float]] = {c: [] for c in configs}
    shares: dict[tuple, list[float]] = {c: [] for c in configs}
    attempts_: dict[tuple, list[int]] = {c: [] for c in configs}
    loads: dict[tuple, list[dict]] = {c: [] for c in configs}
    compress_s: dict[tuple, list[float]] = {c: [] for c in configs}
    info: dict[tuple, dict] = {c: {} for c in configs}
    for rep in range(reps):
        waiter.wait(f"decode repetition {rep + 1}")
        for config in configs:
            name, ratio = config
            label = f"decode {name} ratio={ratio} rep {rep + 1}"
            s, attempts = least_contended(
                functools.partial(
                    decode_sample, model, master, logits, hf_cache, hf_logits, config, length, warmup, n_tokens, checks
                ),
                retries,
                waiter,
                label,
            )
            times = s["times"]
            timed = times[warmup:]
            samples[config].append(1000.0 * sum(timed) / len(timed))
            step_samples[config].extend(1000.0 * t for t in timed)
            shares[config].append(s["share"])
            loads[config].append(s["load"])
            attempts_[config].append(attempts)
            if s["compress_s"] is not None:
                compress_s[config].append(s["compress_s"])
            info[config] = s["info"]
            log(
                f"  decode rep {rep + 1}/{reps} {name:16s} ratio={ratio!s:6s} "
                f"{samples[config][-1]:7.2f} ms/token (warm-up {1000 * sum(times[:warmup]) / max(warmup, 1):.2f})"
                f"  others {s['share']:.0%}"
            )
    full_ms = median(samples[(FULL, None)])
    rows = []
    for config in configs:
        name, ratio = config
        ms = median(samples[config])
        row = {
            "config": name,
            "ratio": ratio,
            "compression": None if ratio is None else round(1.0 / (1.0 - ratio), 3),
            "ms_per_token": ms,
            "ms_per_token_samples": samples[config],
            "ms_per_token_step_median": median(step_samples[config]),
            "ms_per_token_step_p90": float(sorted(step_samples[config])[int(0.9 * (len(step_samples[config]) - 1))]),
            "speedup_vs_full": full_ms / ms,
            "others_cpu_share_samples": shares[config],
            "attempts_per_sample": attempts_[config],
            "load_per_sample": loads[config],
            "compress_s_samples": compress_s[config],
            "compress_s_median": median(compress_s[config]) if compress_s[config] else None,
            **info[config],
        }
        rows.append(row)
    return {
        "context_tokens": length,
        "warmup_tokens": warmup,
        "timed_tokens": n_tokens,
        "repetitions": reps,
        "prefill_observations_for": list(methods),
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------ report
def mib(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def markdown(results: dict) -> str:
    env = results["environment"]
    out = [
        "# kvtrim speed and memory (embedded SmolLM2-135M, CPU)",
        "",
        f"- date (UTC): {env['date_utc']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"kvtrim {env['kvtrim']}, Python {env['python']}",
        f"- timer: **{env['timer']}** ({'elapsed time' if env['timer'] == 'wall' else 'CPU time of the process'}); "
        f"CPU: {env['cpu_model']} ({env['cpu_count']} cores), torch threads {env['torch_threads']}; "
        f"load average at start {env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f}",
        f"- model: {env['num_layers']} layers, {env['num_attention_heads']} query / {env['num_key_value_heads']} "
        f"KV heads, head_dim {env['head_dim']}, {env['model_dtype']}, "
        f"default attention {env['model_default_attention']}",
        f"- run: {'quick' if results['quick'] else 'full'}, {results['runtime_s']:.0f} s in total "
        f"(of which {env['contention']['waited_s']:.0f} s waiting for other processes to leave the CPU)",
        f"- other processes used {env['contention']['prefill_section']['others_share']:.0%} of the machine's CPU "
        f"during the prefill section and {env['contention']['decode_section']['others_share']:.0%} during the decode "
        "section (0% = no contention; per-sample shares are in the JSON)",
        "",
        f"## Prefill (median of repetitions; methods at ratio {PREFILL_RATIO}, i.e. 2x)",
        "",
        "`hf_dynamic_cache` = transformers `DynamicCache` with the model's default attention (reference); "
        "`full` = kvtrim cache and attention path without compression. Prefill of a method includes recording "
        "its observations; compress = scoring + allocation + selection + compaction. Overheads compare "
        "prefill + compress with `full` and with the HF baseline. `others' CPU` is the median share of the "
        "machine's CPU that other processes used during the samples (contention inflates times).",
        "",
        "| tokens | config | reps | prefill s | compress s | total s | tok/s | vs full | vs HF | "
        "KV MiB prefill | KV MiB compressed | entries kept | others' CPU |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["prefill"]:
        comp = r["compress_s_median"]
        kept = f"{r['entries_after_compress']}/{r['entries_after_prefill']}" if "entries_after_compress" in r else "–"
        out.append(
            f"| {r['context_tokens']} | {r['config']} | {r['repetitions']} | {r['prefill_s_median']:.3f} | "
            f"{'–' if comp is None else f'{comp:.3f}'} | {r['prefill_plus_compress_s']:.3f} | "
            f"{r['prefill_tokens_per_s']:.0f} | {r['overhead_vs_full_pct']:+.1f}% | {r['overhead_vs_hf_pct']:+.1f}% | "
            f"{mib(r.get('kv_bytes_after_prefill'))} | {mib(r.get('kv_bytes_after_compress'))} | {kept} | "
            f"{median(r['others_cpu_share_samples']):.0%} |"
        )
    d = results["decode"]
    out += [
        "",
        f"## Decode at {d['context_tokens']} tokens ({d['timed_tokens']} timed tokens after {d['warmup_tokens']} "
        f"warm-up tokens, median over {d['repetitions']} repetitions of the mean ms/token)",
        "",
        "Compressed caches are copies of one kvtrim prefill (observations recorded for "
        f"`{', '.join(d['prefill_observations_for'])}`), compressed with the method, then decoded greedily for a fixed "
        "number of tokens (EOS ignored). `KV MiB after decode` includes the geometric append slack.",
        "",
        "| config | ratio | compression | ms/token | step median | step p90 | speedup vs full | compress s | "
        "entries | KV MiB compressed | theoretical MiB | KV MiB after decode | others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        comp = r.get("compress_s_median")
        factor = "1x" if r["compression"] is None else f"{r['compression']:g}x"
        out.append(
            f"| {r['config']} | {'–' if r['ratio'] is None else r['ratio']} | {factor} | {r['ms_per_token']:.2f} | "
            f"{r['ms_per_token_step_median']:.2f} | {r['ms_per_token_step_p90']:.2f} | {r['speedup_vs_full']:.2f} | "
            f"{'–' if comp is None else f'{comp:.3f}'} | {r.get('entries_after_compress', '–')} | "
            f"{mib(r.get('kv_bytes_after_compress', r.get('kv_bytes_after_prefill')))} | "
            f"{mib(r.get('kv_bytes_theoretical_after_compress'))} | {mib(r.get('kv_bytes_after_decode'))} | "
            f"{median(r['others_cpu_share_samples']):.0%} |"
        )
    b = results["bytes_check"]
    out += [
        "",
        "## Bytes check",
        "",
        f"kvtrim K/V bytes (from `cache.stats().kv_bytes`) vs entries x 2 x head_dim ({env['head_dim']}) x "
        f"{results['bytes_per_element']} bytes, right after prefill and right after compression: "
        f"{b['checked']} checks, {len(b['mismatches'])} mismatches"
        + ("." if not b["mismatches"] else ": " + "; ".join(m["what"] for m in b["mismatches"])),
        "",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short prompts, 1 repetition, few tokens")
    parser.add_argument(
        "--out", default="benchmarks/results/bench_speed_memory/speed_memory.json", help="JSON results path"
    )
    parser.add_argument("--lengths", type=int, nargs="+", help="prefill prompt lengths (default 1024 2048 4096)")
    parser.add_argument("--reps", type=int, help="prefill repetitions (default 3)")
    parser.add_argument("--reps-long", type=int, help="prefill repetitions for prompts over 2048 tokens (default 3)")
    parser.add_argument("--decode-length", type=int, help="prompt length for decode (default 4096)")
    parser.add_argument("--decode-tokens", type=int, help="timed decode tokens (default 64)")
    parser.add_argument("--decode-warmup", type=int, help="untimed decode tokens before timing (default 8)")
    parser.add_argument("--decode-reps", type=int, help="decode repetitions (default 2)")
    parser.add_argument(
        "--wait-idle",
        type=float,
        help="before each prompt length and decode repetition, wait while other processes use >=10%% of the CPU, "
        "up to this many seconds in total (default 1800, 0 with --quick)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        help="re-measure a sample up to this many times while other processes used >=20%% of the CPU during it, "
        "waiting for the CPU to quieten before each new attempt, and keep the least contended attempt "
        "(default 2, 0 with --quick)",
    )
    parser.add_argument(
        "--timer",
        choices=sorted(TIMERS),
        default="wall",
        help="wall: elapsed time (default); cpu: CPU time of the process, for a machine shared with other "
        "processes (use with --threads 1: with several threads, spin-waiting inflates CPU time)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    args = parser.parse_args(argv)

    quick = args.quick
    lengths = args.lengths or ([128, 256] if quick else [1024, 2048, 4096])
    reps = args.reps or (1 if quick else 3)
    reps_long = args.reps_long or (1 if quick else 3)
    decode_length = args.decode_length or (256 if quick else 4096)
    decode_tokens = args.decode_tokens or (8 if quick else 64)
    decode_warmup = args.decode_warmup if args.decode_warmup is not None else (2 if quick else 8)
    decode_reps = args.decode_reps or (1 if quick else 2)
    _timer["name"] = args.timer
    wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if quick or args.timer == "cpu" else 1800.0)
    retries = args.retries if args.retries is not None else (0 if quick or args.timer == "cpu" else 2)
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    model, tokenizer = kvtrim.load_model(MODEL)
    model.eval()
    env = environment(model)
    log(f"environment: {json.dumps(env)}")

    # Warm-up: first calls allocate and pick kernels; not measured.
    warm = build_prompt(tokenizer, 128)
    hf_prefill(model, warm)
    kvtrim_prefill(model, warm, "h2o", 0.5)
    _, c, lg = kvtrim_prefill(model, warm, "snapkv", 0.5)
    compress(model, c, lg)
    decode_steps(model, c, lg, 128, 2, kvtrim_path=True)

    checks: list[tuple[str, int, int]] = []
    waiter = IdleWaiter(wait_idle)
    log("prefill:")
    prefill_monitor = CpuMonitor()
    prefill = bench_prefill(
        model, tokenizer, lengths, PREFILL_METHODS, lambda n: reps_long if n > 2048 else reps, checks, waiter, retries
    )
    prefill_load = prefill_monitor.result()
    log("decode:")
    decode_monitor = CpuMonitor()
    decode = bench_decode(
        model,
        tokenizer,
        decode_length,
        DECODE_METHODS,
        DECODE_RATIOS,
        warmup=decode_warmup,
        n_tokens=decode_tokens,
        reps=decode_reps,
        checks=checks,
        waiter=waiter,
        retries=retries,
    )
    env["load_average_end"] = list(os.getloadavg())
    env["contention"] = {
        "prefill_section": prefill_load,
        "decode_section": decode_monitor.result(),
        "idle_waits": waiter.log,
        "waited_s": waiter.waited_s,
    }
    mismatches = [{"what": w, "kv_bytes": got, "theoretical": want} for w, got, want in checks if got != want]
    results = {
        "quick": quick,
        "environment": env,
        "bytes_per_element": model.dtype.itemsize,
        "prefill": prefill,
        "decode": decode,
        "bytes_check": {"checked": len(checks), "mismatches": mismatches},
        "runtime_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    md = markdown(results)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    log(f"wrote {out} and {out.with_suffix('.md')} ({results['runtime_s']:.0f} s)")
    # Right after prefill or compression the K/V tensors hold exactly the entries (no slack yet).
    assert not mismatches, f"K/V bytes disagree with entries x 2 x head_dim x itemsize: {mismatches}"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
