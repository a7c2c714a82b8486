"""Engine decode-step time vs. decode batch (the engine's H100 target: a step at batch 32 <= 1.5x the step at 4).

For each batch size ``b`` a fresh :class:`kvtrim.serve.engine.Engine` gets ``b`` prompts of ``--context`` tokens
(prose from the jargon haystack, as ``bench_serving_throughput.py``) and a pool that holds each of them twice
uncompressed, so nothing waits, nothing is preempted, and the decode batch stays ``b``. Once every prompt is
prefilled (and, at ``--rate`` > 1, compressed), the engine takes ``--warmup`` steps, then ``--steps`` timed steps;
each step is one batched decode forward plus, with continual compression, one batched eviction. Recorded per batch:
step wall ms (the whole ``Engine.step``), decode ms (the decode forward up to its token read, from
``EngineStats.decode_s``), compression ms per step, KV entries held per sequence, the decode attention / graph
counters the engine reports, and the aten ops of one more step (counted with a dispatch mode: on an accelerator each
non-view op is a kernel launch of an eager step; ``--shape llama-8b-narrow`` has llama-8b's layers and heads at a
width a CPU can run, so the same op count).

Nothing here is specific to a device: ``--shape llama-8b --device cuda --dtype bfloat16 --cuda-graphs`` is the GPU
run; the default (SmolLM2, CPU, fp32) is what this repository's CPU machine can run.

Usage::

    python benchmarks/bench_decode_step.py                             # SmolLM2, CPU, batches 4 and 32
    python benchmarks/bench_decode_step.py --shape llama-8b --device cuda --dtype bfloat16 --context 2048 \
        --rate 8 --decode-kernel auto --cuda-graphs
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from bench_paged_kernels import quant_format
from bench_serving_throughput import SHAPES, load, make_prompts, to_vocab
from kvtrim.serve.engine import Engine
from kvtrim.serve.types import SamplingParams

OUT_DIR = Path(__file__).parent / "results" / "bench_decode_step"


# Ops that only make a view of existing memory (no kernel launch on an accelerator).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "permute", "unsqueeze",
    "squeeze", "alias", "as_strided", "detach", "split", "unbind",
})  # fmt: skip
HOST_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active: on an accelerator, each non-view op is (at least) one launch."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.views = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.views += name in VIEW_OPS
        self.ops += name not in VIEW_OPS
        self.host_reads += name in HOST_READS
        return func(*args, **(kwargs or {}))


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, tok, prompts: list[list[int]], args) -> dict:
    """Steady decode steps of one engine whose batch is ``len(prompts)``."""
    cfg = model.config
    b = len(prompts)
    # Enough tokens that no request finishes before the counted step, however long the staggered prefills take (at
    # worst one chunk per step); the requests are cancelled once measured.
    max_tokens = b * math.ceil(args.context / args.prefill_chunk) + args.warmup + args.steps + 3
    total = args.context + max_tokens + 1
    # Twice every sequence uncompressed: admission counts a running sequence for what it holds and a newcomer for its
    # projected (compressed) size plus its first prefill chunk, uncompressed; with one pool's worth the second of two
    # prompts shorter than a chunk waited for the first to finish.
    blocks = 2 * b * cfg.num_hidden_layers * cfg.num_key_value_heads * math.ceil(total / args.block_size)
    engine = Engine(
        model, tok, kv_blocks=blocks, block_size=args.block_size, compression_rate=args.rate, method=args.method,
        protected_window=args.protected_window, min_cache_tokens=args.min_cache_tokens,
        prefill_chunk=args.prefill_chunk, decode_kernel=args.decode_kernel,
        decode_buckets=args.decode_buckets or args.cuda_graphs or args.static_decode, cuda_graphs=args.cuda_graphs,
        static_decode=args.static_decode, cuda_graph_max_batch=max(64, b),
        kv_quant=None if args.kv_quant == "none" else args.kv_quant,
    )  # fmt: skip
    gc.collect()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    t0 = time.perf_counter()
    while True:  # every prompt prefilled (chunks) and decoding
        engine.step()
        s = engine.stats
        if s.requests_running == b and s.requests_prefilling == 0 and s.prefills == b:
            break
        if not engine.has_work():
            raise RuntimeError("the engine went idle before every prompt was prefilled")
    prefill_wall = time.perf_counter() - t0
    for _ in range(args.warmup):
        engine.step()
    before = engine.stats
    sync(args.device)
    step_ms = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        sync(args.device)
        step_ms.append(1e3 * (time.perf_counter() - t))
    after = engine.stats
    held = [r.paged.entries() / (cfg.num_hidden_layers * cfg.num_key_value_heads) for r in engine.scheduler.running]
    counter, forward = OpCounter(), OpCounter()
    def enter(*_) -> None:  # a hook that returns something replaces the forward's inputs or outputs
        forward.__enter__()

    def leave(*_) -> None:
        forward.__exit__(None, None, None)

    # the model forward of the step alone (the part a CUDA graph captures), inside the step's count
    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        with counter:  # one more step, counted: the launches an eager step issues (a graph replay issues one)
            engine.step()
    finally:
        for h in hooks:
            h.remove()
    steps, fed = after.decode_steps - before.decode_steps, after.decode_tokens - before.decode_tokens
    if steps != args.steps or fed != b * args.steps:
        raise RuntimeError(f"expected {args.steps} decode steps of batch {b}, got {steps} steps feeding {fed}")
    if after.preemptions:
        raise RuntimeError("a sequence was preempted: the pool is too small for the batch")
    for h in handles:
        engine.cancel(h.request_id)
    engine.run_until_idle()
    bad = [o for o in (h.result(timeout=0) for h in handles) if o.error]
    if bad:
        raise RuntimeError(f"a request failed: {bad[0].error}")
    step_ms.sort()
    return {
        "batch": b,
        "context": args.context,
        "compression_rate": args.rate,
        "step_ms_median": step_ms[len(step_ms) // 2],
        "step_ms_mean": sum(step_ms) / len(step_ms),
        "step_ms_min": step_ms[0],
        "decode_ms": 1e3 * (after.decode_s - before.decode_s) / args.steps,
        "compress_ms": 1e3 * (after.compress_s - before.compress_s) / args.steps,
        "tokens_per_s": b * 1e3 / (sum(step_ms) / len(step_ms)),
        "entries_per_head": sum(held) / len(held),
        "prefill_wall_s": prefill_wall,
        "decode_kernel": after.decode_kernel,
        "graph_replays": after.graph_replays - before.graph_replays,
        "graph_captures": after.graph_captures,
        "static_decode_steps": after.static_decode_steps - before.static_decode_steps,
        "ops_per_step": counter.ops,
        "forward_ops_per_step": forward.ops,
        "view_ops_per_step": counter.views,
        "host_reads_per_step": counter.host_reads,
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Engine decode step vs. decode batch",
        "",
        f"Model {meta['model']} ({meta['device']}, {meta['dtype']}), {meta['context']}-token prompts, "
        f"{meta['method']} at compression rate {meta['rate']:g} (continual), block size {meta['block_size']}, "
        f"KV entries {meta.get('kv_quant', 'none')}, "
        f"decode attention {', '.join(sorted({r['decode_kernel'] for r in rows}))}, CUDA graphs "
        f"{'on' if meta['cuda_graphs'] else 'off'}, static decode {'on' if meta['static_decode'] else 'off'}, "
        f"torch threads {meta['threads']}; {meta['steps']} timed steps after {meta['warmup']} warm-up steps.",
        "",
        "| batch | step ms (median) | step ms (mean) | decode ms | compress ms | tok/s | entries per head "
        "| vs first batch (median) | aten ops per step (+ views) | of which in the model forward "
        "| host reads per step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = rows[0]["step_ms_median"] if rows else float("nan")
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['step_ms_median']:.1f} | {r['step_ms_mean']:.1f} | {r['decode_ms']:.1f} "
            f"| {r['compress_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['entries_per_head']:.0f} "
            f"| {r['step_ms_median'] / first:.2f}x | {r['ops_per_step']} (+{r['view_ops_per_step']}) "
            f"| {r['forward_ops_per_step']} | {r['host_reads_per_step']} |"
        )
    lines += ["", f"Command: `{meta['command']}` ({meta['date']}).", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=8.0, help="compression rate (1 = none)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--method", default="kvcompress")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--protected-window", type=int, default=32)
    ap.add_argument("--min-cache-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random-weight shape (default: SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-kernel", choices=["auto", "gather", "flash", "triton"], default="auto")
    ap.add_argument("--kv-quant", type=pool_format, default="none",
                    help="the pool's entries: the model's dtype (none) or packed: int8, int4 (rotated), fp8 or a "
                    "spec string such as int4:rotate=0")  # fmt: skip
    ap.add_argument("--decode-buckets", action="store_true", help="pad decode batches to static buckets")
    ap.add_argument("--static-decode", action="store_true", help="the CUDA-graph step, run eagerly (any device)")
    ap.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (CUDA only)")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    for name in ("steps", "context", "block_size", "prefill_chunk"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def pool_format(spec: str) -> str:
    """``--kv-quant``: ``none`` or a format a block pool takes (checked now, kept as given)."""
    return spec if spec == "none" else quant_format(spec)


def main(argv: list[str] | None = None, model=None, tok=None) -> dict:
    """Run the measurement; ``model`` and ``tok`` (built by the caller, e.g. once for several runs) replace the
    model that ``--shape`` would build."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if model is None:
        model, tok = load(args.shape, args.device, getattr(torch, args.dtype))
    prompts = to_vocab(make_prompts(tok, args.context, max(args.batches)), model.config.vocab_size)
    meta = {
        "model": "smollm2-135m" if args.shape is None else f"random {args.shape}",
        **{k: getattr(args, k) for k in ("device", "dtype", "context", "rate", "method", "block_size", "steps",
                                          "warmup", "threads", "cuda_graphs", "static_decode", "decode_kernel",
                                          "kv_quant")},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python", "benchmarks/bench_decode_step.py", *args.argv]),
    }  # fmt: skip
    rows = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for b in args.batches:
        row = measure(model, tok, prompts[:b], args)
        rows.append(row)
        print(
            f"batch {b:3d}: step {row['step_ms_median']:.1f} ms (decode {row['decode_ms']:.1f}, compress "
            f"{row['compress_ms']:.1f}), {row['tokens_per_s']:.1f} tok/s, {row['entries_per_head']:.0f} entries/head",
            flush=True,
        )
        result = {"meta": meta, "rows": rows}
        (args.out_dir / "decode_step.json").write_text(json.dumps(result, indent=1))
        (args.out_dir / "decode_step.md").write_text(markdown(meta, rows))
    return result


if __name__ == "__main__":
    main()
