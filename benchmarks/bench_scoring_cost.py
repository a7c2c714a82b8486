"""CPU cost of the all-query observation (H2O's cumulative attention) and of CriticalKV's ‖V·W_O‖₁ scoring.

Two parts:

* ``layer``: one Llama-3.1-8B-shaped layer (32 query / 8 KV heads, head_dim 128, hidden 4096), random tensors:
  time and peak bytes allocated by :func:`kvtrim.scoring.observation.record` with ``attn_sum`` over a
  ``--tokens`` prompt, and by :func:`kvtrim.scoring.value_norm.projected_value_norms`;
* ``model``: the embedded SmolLM2-135M on a ``--tokens`` prompt: prefill with kvtrim's uncompressed cache, with
  ``h2o``'s observation, and the compression time of ``h2o``, ``snapkv`` and ``critical_adakv``.

Median of ``--repeats``. Usage: ``python benchmarks/bench_scoring_cost.py --tokens 2048 --label before``; the
results are appended to ``benchmarks/results/bench_scoring_cost/results.jsonl`` (one line per run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import kvtrim
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.eval.haystacks import get_haystack
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.scoring.observation import LayerObservation, ObservationSpec, record
from kvtrim.scoring.value_norm import projected_value_norms

OUT = Path(__file__).resolve().parent / "results" / "bench_scoring_cost"


class _Store:
    """The parts of a dense store that ``record`` reads."""

    def __init__(self, keys: torch.Tensor, positions: torch.Tensor):
        self.keys, self.positions, self.length, self.kv_heads = keys, positions, keys.shape[2], keys.shape[1]
        self._stats: dict[str, torch.Tensor] = {}

    def stat(self, name: str) -> torch.Tensor:
        if name not in self._stats:
            self._stats[name] = torch.zeros(self.positions.shape, device=self.keys.device)
        return self._stats[name]


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_bytes(fn) -> int:
    """Largest total of live CPU bytes allocated while ``fn`` runs (the profiler's per-op self allocations, in
    order; frees count as negative)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = best = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        best = max(best, live)
    return best


def layer_costs(tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 8, tokens, 128, generator=g).to(dtype)
    values = torch.randn(1, 8, tokens, 128, generator=g).to(dtype)
    query = torch.randn(1, 32, tokens, 128, generator=g).to(dtype)
    positions = torch.arange(tokens).view(1, 1, -1).expand(1, 8, -1).contiguous()
    w_o = (torch.randn(4096, 4096, generator=g) * 0.02).to(dtype)
    spec = ObservationSpec(accumulate=("attn_sum",))

    def observe():
        record(spec, LayerObservation(), _Store(keys, positions), query, positions[:, 0], 128**-0.5)

    def norms():
        projected_value_norms(values, w_o)

    return {
        "observe_s": _median_s(observe, repeats),
        "observe_peak_bytes": _peak_bytes(observe),
        "value_norm_s": _median_s(norms, repeats),
        "value_norm_peak_bytes": _peak_bytes(norms),
        "layer_kv_bytes": 2 * keys.numel() * keys.element_size(),
    }


def model_costs(tokens: int, repeats: int, methods: tuple[str, ...] = ("h2o", "snapkv", "critical_adakv")) -> dict:
    model, tok = kvtrim.load_model("smollm2-135m")
    text = get_haystack("jargon") * 4
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    layers = model.config.num_hidden_layers
    out: dict = {"tokens": ids.shape[1]}

    def prefill(cache):
        with torch.inference_mode(), kvtrim_attention_enabled(model):
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    out["prefill_full_s"] = _median_s(lambda: prefill(KVTrimCache(layers, auto_compress=False)), repeats)
    for method in methods:
        pipeline = kvtrim.get_method(method)
        pre, comp, comp_cpu = [], [], []
        for _ in range(repeats):
            cache = KVTrimCache(layers, pipeline, BudgetSpec(ratio=0.875), auto_compress=False)
            t0 = time.perf_counter()
            prefill(cache)
            t1, c1 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                cache.compress()
            pre.append(t1 - t0)
            comp.append(time.perf_counter() - t1)
            comp_cpu.append(time.process_time() - c1)
        out[f"prefill_{method}_s"] = statistics.median(pre)
        out[f"compress_{method}_s"] = statistics.median(comp)
        out[f"compress_{method}_cpu_s"] = statistics.median(comp_cpu)  # steadier than wall time on a shared machine
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-layer", action="store_true", help="only the model part")
    p.add_argument("--methods", default="h2o,snapkv,critical_adakv", help="methods the model part compresses with")
    args = p.parse_args()
    torch.manual_seed(0)
    row = {"label": args.label, "tokens": args.tokens, "repeats": args.repeats, "threads": torch.get_num_threads(),
           "load_average_start": list(os.getloadavg())}  # fmt: skip
    if not args.skip_layer:
        row["layer_fp32"] = layer_costs(args.tokens, torch.float32, args.repeats)
    if not args.skip_model:
        row["smollm2"] = model_costs(args.tokens, args.repeats, tuple(args.methods.split(",")))
    row["load_average_end"] = list(os.getloadavg())
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
