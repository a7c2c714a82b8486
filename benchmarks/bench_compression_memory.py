"""Peak bytes held by live tensors while a cache compresses, above the cache itself, per method.

Uses the meter of ``tests/test_compression_memory.py`` (a TorchDispatchMode that tracks every storage an op
allocates plus the cache's own tensors, and subtracts each when it is freed) on the tiny random Llama of the tests.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_compression_memory.py [--tokens 384] [--batch 2] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from test_compression_memory import LiveBytes, cache_tensors, prefilled  # noqa: E402

METHODS = ["snapkv", "adakv", "pyramidkv", "h2o", "knorm", "critical_adakv"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/bench_compression_memory/peak.json")
    args = parser.parse_args()
    rows = []
    for method in METHODS:
        cache = prefilled(method, batch=args.batch, tokens=args.tokens, layers=args.layers)
        layer_kv = max(layer.store.nbytes() for layer in cache.kv_layers)
        meter = LiveBytes()
        for t in cache_tensors(cache):
            meter.track(t)
        before = meter.live
        with torch.inference_mode(), meter:
            cache.compress()
        rows.append(
            {
                "method": method,
                "tracked_bytes_before": before,
                "layer_kv_bytes": layer_kv,
                "peak_above_bytes": meter.peak - before,
                "peak_above_layers": round((meter.peak - before) / layer_kv, 2),
            }
        )
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = ["| method | one layer K/V bytes | peak above the cache (bytes) | in layers |", "|---|---|---|---|"]
    lines += [
        f"| {r['method']} | {r['layer_kv_bytes']} | {r['peak_above_bytes']} | {r['peak_above_layers']} |" for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
