"""The store's own share of a decode step: append one token and attend, over every layer of AdaKV's ragged cache.

Isolates what the storage layout changes (the model's projections and MLPs are left out, so the comparison is not
drowned by them on a shared machine). SmolLM2-135M, a 2k-token passkey prompt, AdaKV at each ratio; per step, for
each of the 30 layers: ``store.append`` of one token then ``store.attend`` of one query (9 query heads, 3 KV heads).
Run it from two checkouts (``PYTHONPATH=<checkout>/src``) to compare implementations.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_ragged_attention.py [--ratios 0.5,0.875] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.eval.tasks import generate_task
from kvtrim.integration.attention import kvtrim_attention_enabled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ratios", default="0.5,0.875")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--method", default="adakv")
    parser.add_argument("--out", default="benchmarks/results/bench_ragged_attention/ragged_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = kvtrim.load_model("smollm2-135m")
    sample = generate_task("passkey", tok, args.tokens, 1, seed=0)[0]
    session = kvtrim.Session(model, tok, sample.context, methods=[args.method])
    pre = session.prefill
    rows = []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        for ratio in (float(r) for r in args.ratios.split(",")):
            cache = pre.cache.clone(kvtrim.get_method(args.method), kvtrim.BudgetSpec(ratio=ratio))
            cache.compress()
            stores = [layer.store for layer in cache.layers]
            b, h = stores[0].batch_size, stores[0].kv_heads
            d = stores[0].keys.shape[-1] if stores[0].layout == "dense" else stores[0]._k.shape[-1]
            g = torch.Generator().manual_seed(0)
            query = torch.randn(b, model.config.num_attention_heads, 1, d, generator=g)
            kv = torch.randn(b, h, 1, d, generator=g)
            start = int(cache.context_lengths().max())
            times = []
            for step in range(args.steps + 8):
                pos = torch.full((b, 1), start + step)
                t0 = time.process_time()
                for store in stores:
                    store.append(kv, kv, pos)
                    store.attend(query, pos, d**-0.5, fresh_causal=False)
                if step >= 8:
                    times.append(time.process_time() - t0)
            rows.append(
                {
                    "method": args.method,
                    "ratio": ratio,
                    "layouts": sorted({s.layout for s in stores}),
                    "entries": cache.stats().entries,
                    "store_ms_per_step": 1000 * statistics.median(times),
                }
            )
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "load_average": list(os.getloadavg()), "date": time.strftime("%F %T")}
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
