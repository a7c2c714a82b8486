"""Serving throughput vs. KV-Compress compression rate at a fixed KV memory budget (SmolLM2-135M, CPU).

The paper's throughput experiment (KV-Compress, arXiv 2410.00161, §5 / vLLM ``benchmark_throughput.py``) on this
machine: for each input length, the same prompts (real prose from the jargon haystack, cut to exactly that many
tokens, fed as token ids) are all submitted at once to a :class:`kvtrim.serve.engine.Engine` with one fixed pool
of KV blocks and decoded for a fixed number of tokens (end-of-sequence ignored). Compression lets more sequences
share the pool, so the decode batch grows; the engine runs one batched forward over all running sequences per
step. The pool is sized so that at 1x only a few of the longest sequences fit.

Per (input length, compression rate) it records output tokens per second (wall and CPU time of this process,
prefill included), decode-only tokens per second, the largest and the mean decode batch, preemptions,
compressions and evicted blocks, and writes ``serving_throughput.json``, ``serving_throughput.md`` and
``serving_throughput.png`` (throughput vs. compression rate per input length) to the results directory.

``--shape`` swaps the embedded model for a random-weight model of a named shape (``llama-8b``, ``llama-1b``,
``tiny``; prompts are the same SmolLM2 token ids, wrapped into the shape's vocabulary) and ``--device`` picks where
it runs, so one command judges CPU and GPU (``--dtype bfloat16`` for GPU runs). ``--decode-kernel`` picks the
decode attention (``auto``: vLLM's flash-attention fork, else kvtrim's Triton kernel on CUDA, else upstream
flash-attn, when one can run, else gather + SDPA; ``triton`` names the Triton kernel); the one
that ran is recorded per row (``decode_kernel``) and in the markdown.

``--kv-quant none int8 int4`` runs every (input length, compression rate) once per KV format at the same pool
bytes: the pool is sized in bytes (``--kv-memory``, or ``--fit`` / ``--pool-blocks`` times the bytes of an
unquantized block) and a quantized pool packs more blocks into them
(:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`). Rows record the format, the blocks and the bytes
measured from the pool's tensors, and the throughput against the unquantized row of the same length and rate.

Usage::

    python benchmarks/bench_serving_throughput.py             # full run (see NOTES.md for time and command)
    python benchmarks/bench_serving_throughput.py --quick     # smoke run: short prompts, ~1-2 min
    python benchmarks/bench_serving_throughput.py --shape llama-8b --device cuda --dtype bfloat16 \
        --lengths 2048 --prompts 32 --output-tokens 128 --fit 4 --rates 1 4 8
    python benchmarks/bench_serving_throughput.py --lengths 500 --prompts 16 --rates 8 --kv-quant none int8 \
        --fit 1 --decode-kernel gather                                  # cr 8 vs cr 8 + int8 at equal memory
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

import kvtrim
from kvtrim.eval.haystacks import get_haystack
from kvtrim.serve.engine import Engine
from kvtrim.serve.types import SamplingParams

MODEL = "smollm2-135m"
# Random-weight shapes (Llama-3.x configs).
SHAPES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                     tie_word_embeddings=True),
    # llama-8b's layer and head counts at a small width: the same ops per decode step (for counting them on a CPU)
    "llama-8b-narrow": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=8192, max_position_embeddings=131072),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192),
}  # fmt: skip


def load(shape: str | None, device: str, dtype: torch.dtype):
    """The embedded SmolLM2 (``shape`` None) or a random-weight Llama of ``shape``; SmolLM2's tokenizer either way
    (with a shape only the tokenizer is read, so SmolLM2's weights need not be there, e.g. on a GPU machine)."""
    if shape is None:
        model, tok = kvtrim.load_model(MODEL)
        return model.to(device=device, dtype=dtype), tok
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtrim.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    # Built where it runs, in its dtype: no float32 copy first (32 GB for llama-8b) and no cast afterwards.
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model, tok


OUT_DIR = Path(__file__).parent / "results" / "bench_serving_throughput"


def make_prompts(tokenizer, length: int, count: int, haystack: str = "jargon") -> list[list[int]]:
    """``count`` prompts of exactly ``length`` tokens, from different places of the haystack."""
    stride = 997
    need_tokens = stride * (count - 1) + length
    text = get_haystack(haystack)
    ids: list[int] = []
    chars = 6 * need_tokens
    while len(ids) < need_tokens:
        ids = tokenizer(text[:chars])["input_ids"]
        if chars >= len(text):
            raise RuntimeError(f"the {haystack} haystack is too short for {count} prompts of {length} tokens")
        chars *= 2
    return [ids[i * stride : i * stride + length] for i in range(count)]


def to_vocab(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in prompts]


def pool_blocks(model, longest: int, output_tokens: int, fit: float, block_size: int) -> int:
    """Blocks holding ``fit`` uncompressed sequences of the longest input (one table per layer and KV head)."""
    cfg = model.config
    tables = cfg.num_hidden_layers * cfg.num_key_value_heads
    return int(fit * tables * math.ceil((longest + output_tokens) / block_size))


def run_setting(model, tok, prompts, output_tokens: int, rate: float, kv_bytes: int, args, kv_quant=None) -> dict:
    engine = Engine(
        model,
        tok,
        kv_memory_bytes=kv_bytes,
        kv_quant=kv_quant,
        block_size=args.block_size,
        compression_rate=rate,
        method=args.method,
        protected_window=args.protected_window,
        min_cache_tokens=args.min_cache_tokens,
        prefill_chunk=args.prefill_chunk,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_kernel=args.decode_kernel,
        decode_buckets=args.decode_buckets or args.cuda_graphs or args.static_decode,
        cuda_graphs=args.cuda_graphs,
        static_decode=args.static_decode,
    )
    gc.collect()
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    handles = [engine.submit(p, params) for p in prompts]
    engine.run_until_idle()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    outs = [h.result(timeout=0) for h in handles]
    bad = [o.request_id for o in outs if o.finish_reason != "length" or len(o.token_ids) != output_tokens]
    if bad:
        raise RuntimeError(f"requests did not produce {output_tokens} tokens: {bad} ({outs[0].error})")
    s = engine.stats
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "input_len": len(prompts[0]),
        "compression_rate": rate,
        "prompts": len(prompts),
        "output_tokens": output_tokens,
        "kv_quant": kv_quant or "none",
        "pool_blocks": engine.pool.num_blocks,
        "pool_mib": engine.pool.nbytes() / 2**20,
        "pool_bytes_measured": engine.pool.nbytes(),
        "entry_bytes": engine.pool.entry_nbytes(),
        "generated_tokens": generated,
        "wall_s": wall,
        "cpu_s": cpu,
        "out_tok_per_s_wall": generated / wall,
        "out_tok_per_s_cpu": generated / cpu,
        "total_tok_per_s_wall": (generated + sum(len(p) for p in prompts)) / wall,
        "decode_tok_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
        "max_decode_batch": s.max_decode_batch,
        "mean_decode_batch": s.decode_tokens / max(1, s.decode_steps),
        "decode_steps": s.decode_steps,
        "preemptions": s.preemptions,
        "prefills": s.prefills,
        "prefill_tokens": s.prefill_tokens,
        "compressions": s.compressions,
        "blocks_evicted": s.blocks_evicted,
        "peak_blocks_used": s.peak_blocks_used,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "compress_s": s.compress_s,
        "decode_kernel": s.decode_kernel,
        "graph_replays": s.graph_replays,
        "graph_captures": s.graph_captures,
        "graph_invalidations": 0 if engine.runner.graphs is None else engine.runner.graphs.invalidations,
        "graph_capture_s": 0.0 if engine.runner.graphs is None else engine.runner.graphs.capture_s,
        "static_decode_steps": s.static_decode_steps,
    }


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [
        "# Serving throughput vs. compression rate (KV-Compress, fixed KV memory)",
        "",
        f"Model {meta['model']}, {meta['method']}, pool of {meta['pool_mib']:.1f} MiB of K/V "
        f"({meta['pool_blocks']} unquantized blocks of {meta['block_size']} tokens, {meta['dtype']}, "
        f"{meta['device']}) = {meta['fit']:.2f} uncompressed sequences of the longest input, the same bytes for "
        "every KV format (a quantized pool packs more blocks into them); "
        f"{meta['output_tokens']} output tokens per request (EOS ignored), protected window "
        f"{meta['protected_window']}, min cache tokens {meta['min_cache_tokens']}, continual compression; "
        f"torch threads {meta['threads']}; prefill chunk {meta['prefill_chunk']}, "
        f"max_num_batched_tokens {meta['max_num_batched_tokens']}. Prompts per input length: "
        f"{meta['prompts_per_length']}. Decode attention: "
        f"{', '.join(sorted({r['decode_kernel'] for r in rows})) or '-'} (--decode-kernel {meta['decode_kernel']}); "
        f"CUDA graphs {'on' if meta.get('cuda_graphs') else 'off'}, static decode "
        f"{'on' if meta.get('static_decode') else 'off'}.",
        "",
        "Throughput counts generated tokens over the whole run (prefills included); `decode tok/s` counts only "
        "the batched decode forwards.",
        "",
        "`vs 1x` compares with cr 1 of the same KV format and input (wall); `vs none` with the unquantized row of the "
        "same input and cr, by CPU time (the steadier column on a shared machine).",
        "",
        "| input | cr | kv_quant | pool blocks | B/entry | prompts | out tok/s (wall) | out tok/s (CPU) | vs 1x "
        "| vs none (CPU) | decode tok/s | max batch | mean batch "
        "| preempt | compressions | evicted blocks | prefill s | decode s | compress s | wall s "
        "| graphs captured (s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    quant = lambda r: r.get("kv_quant", "none")  # noqa: E731
    base = {(r["input_len"], quant(r)): r["out_tok_per_s_wall"] for r in rows if r["compression_rate"] == 1}
    plain = {(r["input_len"], r["compression_rate"]): r["out_tok_per_s_cpu"] for r in rows if quant(r) == "none"}
    for r in rows:
        ref = base.get((r["input_len"], quant(r)))
        speedup = f"{r['out_tok_per_s_wall'] / ref:.2f}x" if ref else "-"
        ref = plain.get((r["input_len"], r["compression_rate"]))
        vs_none = f"{r['out_tok_per_s_cpu'] / ref:.2f}x" if ref and quant(r) != "none" else "-"
        lines.append(
            f"| {r['input_len']} | {r['compression_rate']:g} | {quant(r)} | {r['pool_blocks']} "
            f"| {r.get('entry_bytes', '-')} | {r['prompts']} | {r['out_tok_per_s_wall']:.1f} "
            f"| {r['out_tok_per_s_cpu']:.1f} | {speedup} | {vs_none} | {r['decode_tok_per_s']:.1f} "
            f"| {r['max_decode_batch']} "
            f"| {r['mean_decode_batch']:.1f} | {r['preemptions']} | {r['compressions']} | {r['blocks_evicted']} "
            f"| {r['prefill_s']:.1f} | {r['decode_s']:.1f} | {r['compress_s']:.1f} | {r['wall_s']:.1f} "
            f"| {r.get('graph_captures', 0)} ({r.get('graph_capture_s', 0.0):.1f}) |"
        )
    lines += ["", f"Total wall time {meta.get('total_wall_s', float('nan')):.0f} s.", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for length in sorted({r["input_len"] for r in rows}):
        sel = sorted((r for r in rows if r["input_len"] == length), key=lambda r: r["compression_rate"])
        rates = [r["compression_rate"] for r in sel]
        axes[0].plot(rates, [r["out_tok_per_s_wall"] for r in sel], marker="o", label=f"{length} input tokens")
        axes[1].plot(rates, [r["max_decode_batch"] for r in sel], marker="o", label=f"{length} input tokens")
    for ax, title in zip(axes, ("output tokens/s (wall, prefill included)", "max decode batch"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression rate")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("KV-Compress serving throughput at a fixed KV memory budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: short prompts, few tokens, three rates")
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--prompts", type=int, nargs="+", default=[10, 6, 4], help="prompts per input length")
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--fit", type=float, default=2.0, help="uncompressed longest sequences the pool holds")
    ap.add_argument("--pool-blocks", type=int, default=None, help="pool size in blocks (overrides --fit)")
    ap.add_argument("--kv-memory", type=int, default=None, help="pool size in bytes (overrides the two above)")
    ap.add_argument(
        "--kv-quant", nargs="+", choices=["none", "int8", "int4"], default=["none"],
        help="KV formats, each run at the same pool bytes",
    )  # fmt: skip
    ap.add_argument("--method", default="kvcompress")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--protected-window", type=int, default=32)
    ap.add_argument("--min-cache-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random-weight shape (default: SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--decode-kernel", choices=["auto", "gather", "flash", "triton"], default="auto",
        help="decode attention: block-table flash-attention kernel (flash), kvtrim's Triton block-table kernel "
        "(triton), gather + SDPA (gather), or auto",
    )  # fmt: skip
    ap.add_argument("--decode-buckets", action="store_true", help="pad decode batches to static buckets")
    ap.add_argument("--static-decode", action="store_true", help="the CUDA-graph decode step, run eagerly")
    ap.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (CUDA only)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        args.lengths, args.prompts, args.rates, args.output_tokens = [128, 256], [4, 4], [1, 4, 16], 24
        args.min_cache_tokens, args.protected_window = 32, 16
    if len(args.prompts) == 1:
        args.prompts = args.prompts * len(args.lengths)
    if len(args.prompts) != len(args.lengths):
        ap.error("--prompts takes one count, or one per input length")
    out_dir = args.out_dir or (OUT_DIR / "quick" if args.quick else OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    model, tok = load(args.shape, args.device, dtype)
    blocks = args.pool_blocks or pool_blocks(model, max(args.lengths), args.output_tokens, args.fit, args.block_size)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    block_bytes = 2 * args.block_size * head_dim * torch.empty((), dtype=dtype).element_size()
    kv_bytes = args.kv_memory or blocks * block_bytes
    blocks = kv_bytes // block_bytes  # unquantized blocks in those bytes
    meta = {
        "model": MODEL if args.shape is None else f"random {args.shape}",
        "device": args.device,
        "dtype": args.dtype,
        "prefill_chunk": args.prefill_chunk,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_kernel": args.decode_kernel,
        "cuda_graphs": args.cuda_graphs,
        "static_decode": args.static_decode,
        "decode_buckets": args.decode_buckets,
        "method": args.method,
        "block_size": args.block_size,
        "pool_blocks": blocks,
        "pool_bytes": kv_bytes,
        "pool_mib": kv_bytes / 2**20,
        "kv_quant": args.kv_quant,
        "fit": blocks / pool_blocks(model, max(args.lengths), args.output_tokens, 1.0, args.block_size),
        "output_tokens": args.output_tokens,
        "protected_window": args.protected_window,
        "min_cache_tokens": args.min_cache_tokens,
        "threads": args.threads,
        "prompts_per_length": dict(zip(args.lengths, args.prompts, strict=True)),
        "rates": args.rates,
        "quick": args.quick,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python", "benchmarks/bench_serving_throughput.py", *argv]),
    }
    rows: list[dict] = []
    t0 = time.perf_counter()
    for length, count in zip(args.lengths, args.prompts, strict=True):
        prompts = to_vocab(make_prompts(tok, length, count), model.config.vocab_size)
        for rate in args.rates:
            for fmt in args.kv_quant:
                quant = None if fmt == "none" else fmt
                row = run_setting(model, tok, prompts, args.output_tokens, rate, kv_bytes, args, quant)
                rows.append(row)
                print(
                    f"input {length:5d} cr {rate:4g} kv {fmt}: {row['out_tok_per_s_wall']:6.1f} out tok/s wall "
                    f"({row['out_tok_per_s_cpu']:.1f} CPU), pool {row['pool_blocks']} blocks, max batch "
                    f"{row['max_decode_batch']:2d}, preemptions {row['preemptions']}, decode attention "
                    f"{row['decode_kernel']}, {row['wall_s']:.0f} s",
                    flush=True,
                )
                meta["total_wall_s"] = time.perf_counter() - t0
                (out_dir / "serving_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                write_markdown(out_dir / "serving_throughput.md", meta, rows)
    plot(out_dir / "serving_throughput.png", rows)
    print(f"total {meta['total_wall_s']:.0f} s; results in {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
