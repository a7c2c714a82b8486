"""Paged decode kernels alone: time per call and achieved memory bandwidth, per shape.

One decode query per (sequence, KV head) row over a paged KV pool laid out as kvtrim's ``BlockPool`` (``[blocks,
block_size, head_dim]``, every row its own block table, blocks shuffled over the pool as after some serving). For
each shape ``batch × context`` (with ``--q-heads``, ``--kv-heads``, ``--head-dim``, ``--block-size``, ``--dtype``)
every available kernel is called through kvtrim's own wrappers (:mod:`kvtrim.cache.paged_kernels`):

* ``triton``: kvtrim's split-K Triton kernel (:mod:`kvtrim.cache.triton_paged`); ``triton+metric`` the same with
  the continual metric fused (``--no-metric`` leaves it out);
* ``vllm_flash_attn``: vLLM's fork of flash-attention and ``flash_attn``: upstream flash-attn 2 (paged mode needs a
  block size that is a multiple of 256), each when importable and when its first call works (else the row says why);
* ``gather``: the gather + SDPA path (every row's blocks gathered into a padded ``[n, kv_heads, S, d]`` copy, then
  one masked SDPA), as :class:`kvtrim.cache.paged.PagedBatchCache` does without a kernel;
* ``triton_quant_int8``, ``triton_quant_int4``, ``triton_quant_int4:rotate=0``, ``triton_quant_fp8``
  (``--quant-formats``, names or spec strings; the option with no format leaves them out): the fused dequantizing
  Triton kernel (:mod:`kvtrim.cache.triton_paged_quant`) over the same keys and values packed as a
  ``QuantizedBlockPool`` holds them (codes plus per-token float16 scale and zero point; int4 in the rotated basis,
  its call rotating the query before and the output after, ``int4:rotate=0`` in the model's channels); its bytes
  are the codes, scales, zero points and block tables, and its output is compared with the gather path over the
  dequantized entries (what the kernel should equal), not over the float ones.

Time: on CUDA, CUDA events around each call (``--warmup`` untimed calls first, which also compile and autotune),
median of ``--iters``, and the same over replays of a CUDA graph of one call (device time without the host's launch
overhead, which at 40-100 µs per layer call would otherwise show in the eager time; ``--no-graphs`` skips it); on
the CPU, wall time (Triton runs under its interpreter there: a smoke test, not a measurement). Bandwidth = bytes
of K and V the rows hold plus their block tables, divided by the median time (the graph's when it was captured);
on CUDA also as a percentage of the device's peak (``--peak-gbps``, else looked up from the device name: H100 SXM
3,350 GB/s). Each kernel's output is compared with the gather path's (max abs difference, untimed).

Usage::

    python benchmarks/bench_paged_kernels.py                                   # CUDA: llama-8b heads, 3 shapes
    python benchmarks/bench_paged_kernels.py --shapes 1x32768 --splits 16 --block-n 64
    python benchmarks/bench_paged_kernels.py --device cpu --shapes 2x64 --q-heads 4 --kv-heads 2 --head-dim 32 \\
        --dtype float32 --iters 2 --warmup 1                                  # CPU smoke run (interpreter)

Writes ``<out-dir>/bench_paged_kernels_<device>.json`` and ``.md`` (default
``benchmarks/results/bench_paged_kernels/``) and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "results" / "bench_paged_kernels"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Peak memory bandwidth (GB/s) by a substring of torch.cuda.get_device_name, most specific first (vendor sheets).
PEAK_GBPS = (
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM5, HBM3
    ("H200", 4800.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("A10G", 600.0),
    ("L4", 300.0),
)
DEFAULT_SHAPES = ("32x2048", "1x32768", "4x8192")
QUANT_FORMATS = ("int8", "int4", "int4:rotate=0", "fp8")  # int4 is rotated in a pool; rotate=0 times it without


def quant_format(spec: str) -> str:
    """``--quant-formats`` item: a format name or spec string a block pool takes (checked now, kept as given)."""
    from kvtrim.cache.quantized_block_pool import pool_kv_quant
    from kvtrim.errors import InvalidParameterError

    try:
        pool_kv_quant(spec)
    except InvalidParameterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def peak_gbps(device_name: str) -> float | None:
    """The device's peak memory bandwidth in GB/s from :data:`PEAK_GBPS`, or None when the name is not listed."""
    for key, value in PEAK_GBPS:
        if key in device_name:
            return value
    return None


def parse_shape(text: str) -> tuple[int, int]:
    batch, _, context = text.lower().partition("x")
    try:
        b, c = int(batch), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxCONTEXT such as 32x2048, got {text!r}") from None
    if b < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be positive, got {text!r}")
    return b, c


class Case:
    """One shape's pool, tables and query: ``rows = batch · kv_heads`` kernel rows of ``context`` entries each."""

    def __init__(self, batch: int, context: int, args: argparse.Namespace, device: torch.device):
        dtype = DTYPES[args.dtype]
        self.batch, self.context = batch, context
        self.group = args.q_heads // args.kv_heads
        self.rows = batch * args.kv_heads
        bs, d = args.block_size, args.head_dim
        self.width = -(-context // bs)
        blocks = self.rows * self.width
        g = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
        self.keys = torch.randn(blocks, bs, d, generator=g, device=device, dtype=dtype)
        self.values = torch.randn(blocks, bs, d, generator=g, device=device, dtype=dtype)
        self.table = torch.randperm(blocks, generator=g, device=device).view(self.rows, self.width).to(torch.int32)
        self.seqlens = torch.full((self.rows,), context, dtype=torch.int32, device=device)
        self.q = torch.randn(self.rows, self.group, d, generator=g, device=device, dtype=dtype)
        self.scale = d**-0.5
        self.metric = torch.zeros(blocks, bs, dtype=torch.float32, device=device)
        self.positions = torch.zeros(blocks, bs, dtype=torch.long, device=device)
        self.qpos = torch.full((batch,), context, dtype=torch.long, device=device)
        self.kv_heads = args.kv_heads
        elt = self.keys.element_size()
        self.bytes_read = 2 * self.rows * context * d * elt + self.rows * self.width * 4  # K, V and block tables
        self._packed: dict[str, tuple] = {}

    def packed(self, fmt: str) -> tuple:
        """``(keys PackedKV, values PackedKV, dequantized case, bytes read)`` for ``fmt``, quantized once per shape
        as a ``QuantizedBlockPool`` writes entries (per-token scales)."""
        if fmt not in self._packed:
            from kvtrim.cache.paged_kernels import PackedKV
            from kvtrim.cache.quant import dequantize_values, quantize_values
            from kvtrim.cache.quantized_block_pool import pool_kv_quant

            quant = pool_kv_quant(fmt)  # a pool's format: no full-precision entries; int4 rotated
            sides, plain = [], []
            for x in (self.keys, self.values):
                codes, scale, zero = quantize_values(x, quant)
                sides.append(PackedKV(codes, scale, zero))
                plain.append(dequantize_values(codes, scale, zero, quant, x.dtype))
            per_entry = sum(t[0, 0].numel() * t.element_size() for side in sides for t in (side.codes, side.scale,
                                                                                            side.zero))  # fmt: skip
            dequantized = copy.copy(self)
            dequantized.keys, dequantized.values, dequantized._packed = plain[0], plain[1], {}
            nbytes = self.rows * self.context * per_entry + self.rows * self.width * 4
            self._packed[fmt] = (sides[0], sides[1], dequantized, nbytes)
        return self._packed[fmt]


def gather_sdpa(case: Case) -> torch.Tensor:
    """The gather + SDPA decode of :class:`kvtrim.cache.paged.PagedBatchCache` (no kernel): ``[rows, G, d]``."""
    from kvtrim.cache.sdpa import sdpa

    n, h = case.batch, case.kv_heads
    bs, d = case.keys.shape[1], case.keys.shape[2]
    table = case.table.long().view(n, h, case.width)
    slots = (table[:, :, :, None] * bs + torch.arange(bs, device=table.device)).reshape(n, h, -1)
    k = case.keys.view(-1, d)[slots]
    v = case.values.view(-1, d)[slots]
    stored = torch.arange(slots.shape[-1], device=table.device) < case.seqlens.view(n, h, 1)
    mask = stored[:, :, None, :].expand(n, h, case.group, slots.shape[-1])
    out = sdpa(case.q.view(n, h, case.group, d), k, v, attn_mask=mask, scale=case.scale)
    return out.reshape(case.rows, case.group, d)


def kernel_calls(case: Case, args: argparse.Namespace) -> dict[str, Callable[[], torch.Tensor] | str]:
    """Each kernel's zero-argument call on ``case``, or the reason it cannot run here."""
    from kvtrim.cache import paged_kernels

    calls: dict[str, Callable[[], torch.Tensor] | str] = {}
    kc, vc = case.keys.unsqueeze(2), case.values.unsqueeze(2)
    max_k = case.width * case.keys.shape[1]
    triton = paged_kernels.triton_kernel()
    if triton is None:
        calls["triton"] = "the triton package is not importable"
    else:
        extra = {"num_splits": args.splits, "block_n": args.block_n}
        calls["triton"] = lambda: triton.call(case.q, kc, vc, case.seqlens, case.table, max_k, case.scale, **extra)[0]
        if not args.no_metric:
            fused = paged_kernels.FusedMetric(case.metric, case.positions, case.qpos, case.kv_heads, 0)

            def with_metric():
                return triton.call(case.q, kc, vc, case.seqlens, case.table, max_k, case.scale, fused, **extra)[0]

            calls["triton+metric"] = with_metric
    found = {k.name: k for k in paged_kernels.available_kernels()}
    for name, multiple in (("vllm_flash_attn", 16), ("flash_attn", 256)):
        kernel = found.get(name)
        if kernel is None:
            calls[name] = "not importable"
        elif case.keys.device.type != "cuda":
            calls[name] = "needs a CUDA device"
        elif case.keys.shape[1] % multiple:
            calls[name] = f"block size {case.keys.shape[1]} is not a multiple of {multiple}"
        else:
            calls[name] = lambda kernel=kernel: kernel.call(
                case.q, kc, vc, case.seqlens, case.table, max_k, case.scale
            )[0]
    calls["gather"] = lambda: gather_sdpa(case)
    if args.quant_formats:
        quant_kernel = paged_kernels.triton_quant_kernel()
        for fmt in args.quant_formats:
            if quant_kernel is None:
                calls[f"triton_quant_{fmt}"] = "the triton package is not importable"
                continue
            keys, values, _, _ = case.packed(fmt)
            options = {"kv_quant": fmt, "num_splits": args.splits, "block_n": args.block_n}
            calls[f"triton_quant_{fmt}"] = lambda keys=keys, values=values, options=options: quant_kernel.call(
                case.q, keys, values, case.seqlens, case.table, max_k, case.scale, **options
            )[0]
    return calls


def time_call(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_graph(fn: Callable[[], torch.Tensor], device: torch.device, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` replays of ``fn`` captured in a CUDA graph: device time without the host's
    launch overhead (the way the engine's decode step runs with ``cuda_graphs=True``)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def measure(case: Case, args: argparse.Namespace, device: torch.device, peak: float | None) -> list[dict]:
    rows = []
    plain_want = gather_sdpa(case).float()
    for name, call in kernel_calls(case, args).items():
        if args.kernels and name not in args.kernels:
            continue
        row = {"batch": case.batch, "context": case.context, "rows": case.rows, "kernel": name}
        if isinstance(call, str):
            rows.append({**row, "status": "skipped", "reason": call})
            continue
        want, nbytes = plain_want, case.bytes_read
        if name.startswith("triton_quant_"):  # against the gather path over the dequantized entries, packed bytes
            _, _, dequantized, nbytes = case.packed(name.removeprefix("triton_quant_"))
            want = gather_sdpa(dequantized).float()
        try:
            err = (call().float() - want).abs().max().item()
            times = time_call(call, device, args.warmup, args.iters)
        except Exception as exc:  # a kernel that imports but fails here is reported, and the run goes on
            rows.append({**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        ms = statistics.median(times)
        row.update(status="ok", ms_median=ms, ms_min=min(times), ms_max=max(times), bytes_read=nbytes)
        graph_ms = None
        if device.type == "cuda" and not args.no_graphs:
            try:
                graph_ms = statistics.median(time_graph(call, device, args.iters))
            except Exception as exc:  # reported; the eager time stands
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["graph_ms_median"] = graph_ms
        row["timed"] = "eager" if graph_ms is None else "graph"
        gbps = nbytes / ((graph_ms or ms) * 1e-3) / 1e9
        row.update(gbps=gbps, pct_peak=None if peak is None else 100 * gbps / peak, max_abs_diff_vs_gather=err)
        if name.startswith("triton"):
            row.update(triton_details(case, args, device, quant=name.startswith("triton_quant_")))
        rows.append(row)
    return rows


def triton_details(case: Case, args: argparse.Namespace, device: torch.device, quant: bool = False) -> dict:
    """The split plan and the tile the Triton kernel (``quant``: the fused dequantizing one) ran with."""
    from kvtrim.cache import triton_paged, triton_paged_quant

    max_tokens = case.width * case.keys.shape[1]
    splits, chunk = triton_paged.split_plan(case.rows, max_tokens, triton_paged.device_sms(device), args.splits)
    interpret = triton_paged.interpreter_on()
    tuned = triton_paged_quant._partial(interpret)[1] if quant else triton_paged._kernels(interpret)[1]
    best = getattr(tuned, "best_config", None)
    config = args.block_n and {"BLOCK_N": args.block_n, "num_warps": 4}
    if config is None and best is not None:
        config = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    return {"splits": splits, "chunk": chunk, "config": config}


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Paged decode kernels: {meta['device_name']} ({meta['device']}), {meta['dtype']}",
        "",
        f"q heads {meta['q_heads']}, KV heads {meta['kv_heads']}, head_dim {meta['head_dim']}, block size "
        f"{meta['block_size']}; median of {meta['iters']} calls after {meta['warmup']} (eager, and replays of a CUDA "
        f"graph of one call on CUDA); bandwidth = K/V + block-table bytes / median time (the graph's when captured; "
        f"triton_quant_*: codes, scales, zero points and block tables, output compared with gather over the "
        f"dequantized entries); "
        + (f"peak {meta['peak_gbps']:g} GB/s" if meta["peak_gbps"] else "no peak bandwidth known (--peak-gbps)")
        + f". {meta['date']}",
        "",
        "| batch × context | kernel | ms eager | ms graph | GB/s | % peak | splits × chunk | tile | max diff vs gather "
        "| status |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in result["rows"]:
        shape = f"{r['batch']} × {r['context']}"
        if r["status"] != "ok":
            lines.append(f"| {shape} | {r['kernel']} | | | | | | | | {r['status']}: {r['reason']} |")
            continue
        pct = "" if r["pct_peak"] is None else f"{r['pct_peak']:.1f}"
        split = f"{r['splits']} × {r['chunk']}" if "splits" in r else ""
        tile = "" if not r.get("config") else ", ".join(f"{k}={v}" for k, v in r["config"].items())
        graph = "" if r["graph_ms_median"] is None else f"{r['graph_ms_median']:.4g}"
        status = "ok" if "graph_error" not in r else f"ok (no graph: {r['graph_error']})"
        lines.append(
            f"| {shape} | {r['kernel']} | {r['ms_median']:.4g} | {graph} | {r['gbps']:.1f} | {pct} | {split} | "
            f"{tile} | {r['max_abs_diff_vs_gather']:.2e} | {status} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                   help="BATCHxCONTEXT, default: " + " ".join(DEFAULT_SHAPES))  # fmt: skip
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--kernels", nargs="+", default=None, help="only these (triton, triton+metric, vllm_flash_attn, "
                   "flash_attn, gather, triton_quant_int8, triton_quant_int4, triton_quant_fp8)")  # fmt: skip
    p.add_argument("--quant-formats", nargs="*", type=quant_format, default=list(QUANT_FORMATS),
                   help="packed formats of the fused dequantizing Triton kernel, names or spec strings such as "
                   "int4:rotate=0 (none given: left out)")  # fmt: skip
    p.add_argument("--no-metric", action="store_true", help="leave out triton+metric")
    p.add_argument("--splits", type=int, default=None, help="force the Triton kernel's splits per row")
    p.add_argument("--block-n", type=int, default=None, help="force the Triton kernel's tokens per loop step")
    p.add_argument("--no-graphs", action="store_true", help="time eager calls only (default on CUDA: also graphs)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--peak-gbps", type=float, default=None, help="the device's peak bandwidth (default: by name)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return args


# The kernel's bandwidth targets: % of the device's peak for kvtrim's Triton kernel (no metric) at these shapes.
BANDWIDTH_TARGETS = {(32, 2048): 50.0, (1, 32768): 30.0}


def bandwidth_targets(rows: list[dict]) -> list[dict]:
    """``[{name, value, limit, op}]``, one per target shape; value None where the shape was not run or no peak is
    known (a CPU run, or an unknown device without ``--peak-gbps``)."""
    out = []
    for (batch, context), limit in BANDWIDTH_TARGETS.items():
        hit = [r for r in rows if r["kernel"] == "triton" and r["status"] == "ok"
               and (r["batch"], r["context"]) == (batch, context)]  # fmt: skip
        value = hit[0]["pct_peak"] if hit else None
        out.append({"name": f"triton % of peak bandwidth, batch {batch} x {context}", "value": value,
                    "limit": limit, "op": ">="})  # fmt: skip
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton runs on CPU tensors only under its interpreter
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = args.peak_gbps
    if peak is None and device.type == "cuda":
        peak = peak_gbps(device_name)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = {
        "device": str(device), "device_name": device_name, "peak_gbps": peak, "dtype": args.dtype,
        "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
        "warmup": args.warmup, "iters": args.iters, "splits": args.splits, "block_n": args.block_n,
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
    }  # fmt: skip
    rows = []
    for batch, context in args.shapes:
        case = Case(batch, context, args, device)
        for row in measure(case, args, device, peak):
            rows.append(row)
            shown = row.get("reason", "")
            if row["status"] == "ok":
                shown = f"{row['ms_median']:.4g} ms eager, {row['gbps']:.0f} GB/s ({row['timed']})"
            print(f"{batch:>4} x {context:<7} {row['kernel']:>16}  {shown}", flush=True)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"meta": meta, "rows": rows, "targets": bandwidth_targets(rows)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_paged_kernels_{device.type}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
