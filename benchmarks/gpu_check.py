"""The GPU check, in stages that each fit one bounded device run (docs/gpu-check.md).

    python benchmarks/gpu_check.py STAGE [STAGE ...] [--device cuda|cpu] [--out-dir DIR]
    bash benchmarks/gpu_check.sh STAGE ...          # the same, with src/ on the path and .gpu/ used when present

Stages (each writes ``gpu_check_<stage>.json`` and ``.md`` to ``--out-dir``, default ``$OUT`` when set, else
``benchmarks/results/gpu_check/<stage>/``, and prints a one-screen summary with every target, measured value,
limit and met / not met). On ``--device cuda`` the model is a random-weight llama-8b shape built once per stage,
directly on the GPU in bfloat16; ``--device cpu`` runs the same code at the ``tiny`` shape in float32 (Triton's
interpreter for Triton kernels), so every stage can be run end to end without a GPU.

H100 time per stage, estimated from arithmetic before the first run (measured on one H100, 2026-11-26: tests 89 s,
kernels 13 s, methods 155 s for seven methods, step 58 s; docs/gpu-check.md). Assumed: bf16 matrix
work at ~500 TFLOP/s in linear layers and ~350 TFLOP/s in flash attention, 3 TB/s of HBM, ~14 GFLOP per token for
llama-8b's linear layers (7 B non-embedding parameters; only the last position's logits), ~15 s to build the model.

* ``tests``  ~3 min. Every CUDA test file (the required ones plus any file under tests/ that checks for CUDA),
  tiny models; dominated by Triton compiles (~40 specialisations x ~2 s) and a few dozen tiny engine runs. The
  pytest run is stopped at 7.5 min.
* ``kernels`` bounded by ``bench_paged_kernels.py``'s own defaults; stopped at 7.5 min. Besides the float kernels it
  times the fused dequantizing Triton kernel over int8, int4 and fp8 copies of the same pool (rows
  ``triton_quant_*``: packed bytes per second, output against gather over the dequantized entries); its three
  autotunings (one per format, ~6 tiles x ~2 s of compile each) add ~40 s to the 13 s measured without it.
* ``methods`` ~3.5 min (4.5 at worst). 7 methods x contexts {4k, 32k} x batches {1, 8}: 332 k prompt tokens per
  method = 4.6 PFLOP linear (9 s) + 2.6 PFLOP causal attention (7.5 s; ~15 s if a masked prefill piece falls back
  from flash to the memory-efficient kernel), ~17-24 s of prefill; + compression and 4 x 19 decode steps (<= 50 ms
  each at batch 8 x 32k: 34 GB of K/V + 16 GB of weights at 3 TB/s) -> ~25-32 s per method, 175-225 s; + build
  and warm-up ~35 s. The K/V of batch 8 x 32k is 34 GB: with 16 GB of weights it fits 80 GB only because
  the prompt is fed in 4096-token pieces.
* ``step``   ~2 min. 3 decode kernels x {eager, graphs} x batches {4, 32} = 12 engine runs at 2k context:
  442 k prompt tokens (6.2 PFLOP, ~13 s), 12 x ~27 steps at <= 100 ms, graph captures and compiles ~30 s, build.
* ``throughput`` ~2.5 min. 32 prompts of 2048 tokens, 128 output tokens, cr 1 / 4 / 8 in a pool that holds 4
  uncompressed sequences: ~300 k prompt tokens with re-prefills (~10 s), ~1,400 decode steps at <= 50 ms of host
  and device time each (~70 s), captures and build ~30 s.

Every stage must finish in well under 8 minutes; cut ``--methods``/``--contexts``/``--batches`` before adding.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results" / "gpu_check"
KERNELS_SCRIPT = BENCH / "bench_paged_kernels.py"
WHEELS = ROOT / ".gpu" / "wheels"
STAGES = ("tests", "kernels", "methods", "step", "throughput")
SCHEMA = 1
# CUDA test files run whatever they contain; any other test file that checks for CUDA is found by this pattern.
REQUIRED_TESTS = (
    "tests/serve/test_engine_cuda.py",
    "tests/cache/test_paged_kernels.py",
    "tests/cache/test_triton_paged.py",
    "tests/cache/test_triton_paged_quant.py",
    "tests/serve/test_engine_triton.py",
)
CUDA_TEST_PATTERN = re.compile(r"torch\.cuda\.is_available\(\)|mark\.cuda\b|requires_cuda")
SUBPROCESS_LIMIT_S = 450
# Decode kernels of the step stage; gather and triton must run on every CUDA machine, flash needs a package.
STEP_KERNELS = ("gather", "triton", "flash")
REQUIRED_KERNELS = ("gather", "triton")

# Per device: the shape and sizes of every stage. CUDA: docs/gpu-check.md's llama-8b runs; CPU: the same code, tiny.
PROFILES: dict[str, dict[str, Any]] = {
    "cuda": {
        "dtype": "bfloat16",
        "methods": {"shape": "llama-8b", "contexts": [4096, 32768], "batches": [1, 8], "steps": 16, "warmup": 3,
                    "prefill_chunk": 4096, "ratio": 0.875},
        "step": {"shape": "llama-8b", "context": 2048, "batches": [4, 32], "rate": 8.0, "steps": 20, "warmup": 3,
                 "min_cache_tokens": 128, "protected_window": 32, "prefill_chunk": 512},
        "throughput": {"shape": "llama-8b", "lengths": [2048], "prompts": [64], "output_tokens": 128, "fit": 4.0,
                       "rates": [1.0, 4.0, 8.0], "min_cache_tokens": 128, "protected_window": 32,
                       "quant_rate": 8.0, "kv_quant": ["int8", "int4"]},
    },
    "cpu": {
        "dtype": "float32",
        "methods": {"shape": "tiny", "contexts": [256, 512], "batches": [1, 2], "steps": 2, "warmup": 1,
                    "prefill_chunk": 4096, "ratio": 0.875},
        "step": {"shape": "tiny", "context": 96, "batches": [1, 3], "rate": 4.0, "steps": 3, "warmup": 1,
                 "min_cache_tokens": 16, "protected_window": 8, "prefill_chunk": 512},
        "throughput": {"shape": "tiny", "lengths": [128], "prompts": [8], "output_tokens": 16, "fit": 2.0,
                       "rates": [1.0, 4.0, 8.0], "min_cache_tokens": 16, "protected_window": 8,
                       "quant_rate": 8.0, "kv_quant": ["int8"]},
    },
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- results
def target(name: str, value: float | None, limit: float, op: str = "<=") -> dict:
    """One target row: ``met`` is None when the value could not be measured."""
    if op not in ("<=", ">="):
        raise ValueError(f"op must be '<=' or '>=', got {op!r}")
    met = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return {"name": name, "value": value, "limit": limit, "op": op, "met": met}


def _versions() -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # recorded: a CUDA machine without Triton cannot run the Triton kernel
        triton_version = f"not importable ({type(exc).__name__})"
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}  # fmt: skip


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def new_result(stage: str, device: str) -> dict:
    return {
        "schema": SCHEMA,
        "stage": stage,
        "status": "ok",
        "device": device,
        "device_name": _device_name(device),
        **_versions(),
        "dtype": PROFILES[device]["dtype"],
        "shapes": {},
        "settings": {},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
        "wall_s": None,
        "rows": [],
        "targets": [],
        "errors": [],
        "files": [],
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _met(t: dict) -> str:
    return "not measured" if t["met"] is None else ("met" if t["met"] else "NOT MET")


def markdown(result: dict) -> str:
    lines = [
        f"# GPU check: {result['stage']} on {result['device_name']} ({result['device']}, {result['dtype']})",
        "",
        f"Status **{result['status']}**, {_fmt(result['wall_s'])} s. torch {result['torch']}, triton "
        f"{result['triton']}, transformers {result['transformers']}, CUDA {result['cuda']}; {result['date']}.",
        f"Command: `{result['command']}`.",
        "",
    ]
    if result["shapes"]:
        lines += ["Shapes: " + "; ".join(f"{k}: {v}" for k, v in result["shapes"].items()), ""]
    if result["targets"]:
        lines += ["| target | value | limit | result |", "|---|---:|---:|---|"]
        lines += [f"| {t['name']} | {_fmt(t['value'])} | {t['op']} {_fmt(t['limit'])} | {_met(t)} |"
                  for t in result["targets"]]  # fmt: skip
        lines.append("")
    if result["errors"]:
        lines += ["Errors:", ""] + [f"* {e}" for e in result["errors"]] + [""]
    rows = result["rows"]
    if rows:
        keys = [k for k in dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], dict | list))]
        keys = [k for k in keys if k != "error"][:12] + (["error"] if "error" in keys else [])
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(r.get(k)).replace("|", "/")[:160] for k in keys) + " |" for r in rows]
        lines.append("")
    if result["files"]:
        lines += ["Files: " + ", ".join(f"`{f}`" for f in result["files"]), ""]
    return "\n".join(lines)


def summary(result: dict, limit_rows: int = 10) -> str:
    """At most one screen: status, targets, errors, the first rows' key values, files."""
    out = [
        f"== gpu_check {result['stage']}: {result['status'].upper()} on {result['device_name']} "
        f"({result['device']}, {result['dtype']}) in {_fmt(result['wall_s'])} s; torch {result['torch']}, "
        f"triton {result['triton']}"
    ]
    for t in result["targets"]:
        out.append(f"  [{_met(t):>12}] {t['name']}: {_fmt(t['value'])} (limit {t['op']} {_fmt(t['limit'])})")
    if not result["targets"]:
        out.append("  (no targets)")
    for e in result["errors"][:5]:
        out.append(f"  ERROR {e[:200]}")
    out.append(f"  {len(result['rows'])} rows; files: {', '.join(result['files'])}")
    return "\n".join(out)


def write(result: dict, out_dir: Path) -> None:
    stem = out_dir / f"gpu_check_{result['stage']}"
    result["files"] = sorted({*result["files"], stem.name + ".json", stem.name + ".md"})
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))


def _error(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb))
    return f"{type(exc).__name__}: {str(exc)[:400]} @ {where}"


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- tests
def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The required CUDA test files and every other test file under ``tests/`` that checks for CUDA."""
    found = [
        str(p.relative_to(root))
        for p in sorted((root / "tests").rglob("test_*.py"))
        if CUDA_TEST_PATTERN.search(p.read_text(encoding="utf-8", errors="replace"))
    ]
    return list(dict.fromkeys([*REQUIRED_TESTS, *found]))


def _pytest_path(install_wheels: bool, workdir: Path) -> str | None:
    """``None`` when this interpreter has pytest and no install was asked for; else a folder holding pytest and
    its needs, installed from ``.gpu/wheels`` (``make gpu-bundle``). Raises when neither is there."""
    if not install_wheels:
        try:
            import pytest  # noqa: F401

            return None
        except ImportError:
            pass
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pytest is not importable and {WHEELS} holds no wheels: run `make gpu-bundle`, carry .gpu")
    target_dir = workdir / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target_dir), *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=120)
    return str(target_dir)


def parse_junit(path: Path) -> list[dict]:
    """One row per test case of a JUnit XML report: ``test``, ``outcome``, ``time_s``, ``message``."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                lines = (child.get("message") or child.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rows.append({"test": name, "outcome": outcome, "time_s": float(case.get("time") or 0.0), "message": message})
    return rows


def _junit_name(nodeid: str) -> str:
    """``tests/a/test_b.py::Class::test_c[x]`` as JUnit names it: ``tests.a.test_b.Class::test_c[x]``."""
    path, *classes, name = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *classes]) + f"::{name}"


def stage_tests(args, result: dict, out_dir: Path) -> None:
    files = args.test_files or cuda_test_files()
    missing = [f for f in files if not (ROOT / f).exists()]
    if missing:
        result["errors"].append(f"CUDA test files missing: {missing}")
        files = [f for f in files if f not in missing]
    result["settings"] = {"files": files, "sync_debug_mode": args.sync_debug, "limit_s": args.limit_s}
    junit = out_dir / "gpu_check_tests_junit.xml"
    sync_report = out_dir / "gpu_check_tests_sync.json"
    log = out_dir / "gpu_check_tests.log"
    for p in (junit, sync_report):
        p.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        extra = _pytest_path(args.install_wheels, Path(tmp))
        path = [str(ROOT / "src"), str(BENCH), *([extra] if extra else []), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
               "KVTRIM_SYNC_DEBUG": args.sync_debug, "KVTRIM_SYNC_DEBUG_REPORT": str(sync_report)}  # fmt: skip
        probe = [sys.executable, "-c", "import pytest; print(pytest.__version__, pytest.__file__)"]
        result["settings"]["pytest"] = subprocess.run(
            probe, env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "gpu_sync_debug",
               "--durations=15", f"--junitxml={junit}", *files]  # fmt: skip
        with log.open("w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=args.limit_s).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = None
                result["errors"].append(f"pytest stopped after {args.limit_s} s")
    result["files"] += [log.name]
    if junit.exists():
        result["rows"] = parse_junit(junit)
        result["files"].append(junit.name)
    else:
        result["errors"].append(f"pytest wrote no report (exit code {rc}); see {log.name}")
    counts = {k: sum(r["outcome"] == k for r in result["rows"]) for k in ("passed", "failed", "error", "skipped")}
    result["settings"]["counts"] = counts
    if rc not in (0, None) and not counts["failed"] and not counts["error"]:
        result["errors"].append(f"pytest exited with code {rc}; see {log.name}")
    guarded = None
    if sync_report.exists():
        report = json.loads(sync_report.read_text())
        guarded = report["decode_forwards"]
        result["files"].append(sync_report.name)
        per_test = {_junit_name(k): v for k, v in report["per_test"].items()}
        for r in result["rows"]:
            r["decode_forwards_guarded"] = per_test.get(r["test"], 0)
    result["targets"] = [
        target("CUDA tests failed or errored", counts["failed"] + counts["error"], 0),
        target("CUDA tests passed", counts["passed"], 1, ">="),
        target(f"decode forwards run under sync debug mode {args.sync_debug!r}", guarded, 1, ">="),
    ]
    for r in result["rows"]:
        if r["outcome"] != "passed":
            print(f"  {r['outcome']:>7} {r['test']}: {r['message'][:150]}")
    if counts["failed"] or counts["error"]:
        result["errors"].append(f"{counts['failed']} failed, {counts['error']} errors; see {log.name}")


# ---------------------------------------------------------------------------------------------------- kernels
def stage_kernels(args, result: dict, out_dir: Path) -> None:
    script = KERNELS_SCRIPT
    result["settings"] = {"script": str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)}
    if not script.exists():
        raise FileNotFoundError(f"{script} does not exist: the kernels stage runs it and cannot measure without it")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    sub = out_dir / "kernels"
    sub.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script), "--device", args.device, "--dtype", dtype, "--out-dir", str(sub)]
    if args.device == "cpu":  # Triton's interpreter: a tiny shape checks the stage, the defaults would take hours
        cmd += ["--shapes", "2x64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", "--iters", "2",
                "--warmup", "1"]  # fmt: skip
    path = (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")
    result["settings"]["command"] = " ".join(cmd[1:])
    log = out_dir / "gpu_check_kernels.log"
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=args.limit_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    result["files"].append(log.name)
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        result["errors"].append(
            f"{script.name} {'ran past ' + str(args.limit_s) + ' s' if rc is None else 'exited ' + str(rc)}: "
            + " / ".join(tail)
        )
    produced = sorted(sub.glob("*.json"))
    result["files"] += [f"kernels/{p.name}" for p in sorted(sub.iterdir()) if p.is_file()]
    if rc == 0 and not produced:
        result["errors"].append(f"{script.name} wrote no JSON to {sub}")
    for p in produced:
        data = json.loads(p.read_text())
        if isinstance(data, dict):
            result["rows"] += [{"file": p.name, **r} for r in data.get("rows", []) if isinstance(r, dict)]
            for t in data.get("targets", []):
                if isinstance(t, dict) and {"name", "value", "limit"} <= t.keys():
                    result["targets"].append(target(t["name"], t["value"], t["limit"], t.get("op", ">=")))
    if produced and not result["targets"]:
        # the bandwidth targets are the point of the stage: a JSON without them is a contract broken, not a pass
        result["errors"].append(
            f"{script.name}'s JSON has no 'targets' list of {{name, value, limit[, op]}} (the bandwidth targets)"
        )


def _keep_json(bench_dir: Path, out_dir: Path, name: str | None = None) -> str:
    """Copy the one JSON a benchmark wrote to ``bench_dir`` into ``out_dir`` (its markdown and plots stay behind:
    the stage's markdown holds the rows, and a device run brings back only a few files), as ``name`` (default: its
    own name); returns the name."""
    (path,) = sorted(bench_dir.glob("*.json"))
    name = name or path.name
    (out_dir / name).write_text(path.read_text())
    return name


# ---------------------------------------------------------------------------------------------------- methods
def method_targets(rows: list[dict], hf: str = "hf", full: str = "full", ragged: str = "adakv",
                   dense: str = "snapkv") -> list[dict]:  # fmt: skip
    """The decode-step targets per (context, batch): every compressed method <= 1.1x kvtrim's full cache; kvtrim
    full <= 0.5x HF's default cache; the ragged store (AdaKV) <= 1.15x the dense one (SnapKV, same ratio)."""
    ms = {(r["method"], r["context"], r["batch"]): r.get("decode_ms") for r in rows}
    configs = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))

    def ratio(a: str, b: str, c: int, n: int) -> float | None:
        x, y = ms.get((a, c, n)), ms.get((b, c, n))
        return None if not x or not y else x / y

    out = []
    for c, n in configs:
        where = f"ctx {c}, batch {n}"
        if (full, c, n) in ms and (hf, c, n) in ms:
            out.append(target(f"kvtrim full / HF default decode ({where})", ratio(full, hf, c, n), 0.5))
        if (ragged, c, n) in ms and (dense, c, n) in ms:
            out.append(target(f"ragged {ragged} / dense {dense} decode ({where})", ratio(ragged, dense, c, n), 1.15))
        for m in methods:
            if m not in (hf, full) and (full, c, n) in ms:
                out.append(target(f"{m} / kvtrim full decode ({where})", ratio(m, full, c, n), 1.1))
    return out


def stage_methods(args, result: dict, out_dir: Path) -> None:
    import bench_gpu

    p = {**PROFILES[args.device]["methods"]}
    p["contexts"] = args.contexts or p["contexts"]
    p["batches"] = args.batches or p["batches"]
    argv = ["--shape", p["shape"], "--device", args.device, "--dtype", PROFILES[args.device]["dtype"],
            "--contexts", ",".join(map(str, p["contexts"])), "--batches", ",".join(map(str, p["batches"])),
            "--steps", str(args.steps or p["steps"]), "--decode-warmup", str(p["warmup"]),
            "--prefill-chunk", str(p["prefill_chunk"]), "--ratio", str(p["ratio"])]  # fmt: skip
    if args.methods:
        argv += ["--methods", args.methods]
    result["settings"] = {"bench_gpu_args": argv}
    result["shapes"] = {p["shape"]: bench_gpu.SHAPES[p["shape"]]}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = bench_gpu.main([*argv, "--out", tmp])
        result["files"].append(_keep_json(Path(tmp), out_dir))
    keep = ("method", "context", "batch", "status", "prefill_s", "compress_s", "decode_ms", "kv_bytes_prefill",
            "kv_bytes_compressed", "peak_decode_above_base_bytes", "error")  # fmt: skip
    result["rows"] = [{k: r.get(k) for k in keep if k in r} for r in out["rows"]]
    result["targets"] = method_targets(out["rows"])
    bad = [f"{r['method']} ctx {r['context']} b {r['batch']}: {r['status']} {r.get('error', '')[:150]}"
           for r in out["rows"] if r["status"] != "ok"]  # fmt: skip
    result["errors"] += bad


# ---------------------------------------------------------------------------------------------------- step
def stage_step(args, result: dict, out_dir: Path) -> None:
    import torch

    from bench_decode_step import measure, parse_args
    from bench_serving_throughput import SHAPES, load, make_prompts, to_vocab
    from kvtrim.cache.paged_kernels import resolve_decode_kernel
    from kvtrim.errors import InvalidParameterError

    p = PROFILES[args.device]["step"]
    dtype_name = PROFILES[args.device]["dtype"]
    batches = args.batches or p["batches"]
    steps = args.steps or p["steps"]
    kernels = args.kernels or list(STEP_KERNELS)
    # On a CPU the graph step runs eagerly (static decode): the same kernels, the same buffers, no capture.
    modes = ("eager", "graphs") if args.device == "cuda" else ("eager", "static")
    result["shapes"] = {p["shape"]: SHAPES[p["shape"]]}
    result["settings"] = {**p, "batches": batches, "steps": steps, "kernels": kernels, "modes": modes}
    model, tok = load(p["shape"], args.device, getattr(torch, dtype_name))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    prompts = to_vocab(make_prompts(tok, p["context"], max(batches)), cfg.vocab_size)
    for kernel in kernels:
        try:
            resolve_decode_kernel(kernel, device=args.device, dtype=model.dtype, block_size=16, head_dim=head_dim)
        except InvalidParameterError as exc:
            result["rows"].append({"kernel": kernel, "mode": "-", "status": "unavailable", "error": str(exc)[:300]})
            if kernel in REQUIRED_KERNELS:
                result["errors"].append(f"decode kernel {kernel} cannot run here: {exc}")
            print(f"  {kernel}: unavailable ({str(exc)[:150]})", flush=True)
            continue
        for mode in modes:
            argv = ["--device", args.device, "--dtype", dtype_name, "--context", str(p["context"]),
                    "--rate", str(p["rate"]), "--steps", str(steps), "--warmup", str(p["warmup"]),
                    "--min-cache-tokens", str(p["min_cache_tokens"]), "--protected-window", str(p["protected_window"]),
                    "--prefill-chunk", str(p["prefill_chunk"]), "--decode-kernel", kernel,
                    "--out-dir", str(out_dir)]  # fmt: skip
            argv += {"eager": [], "graphs": ["--cuda-graphs"], "static": ["--static-decode"]}[mode]
            bargs = parse_args(argv)
            for b in batches:
                row = {"kernel": kernel, "mode": mode, "batch": b}
                try:
                    m = measure(model, tok, prompts[:b], bargs)
                    row.update(status="ok", **{k: m[k] for k in (
                        "step_ms_median", "decode_ms", "compress_ms", "tokens_per_s", "entries_per_head",
                        "decode_kernel", "graph_replays", "graph_captures", "static_decode_steps",
                        "host_reads_per_step")})  # fmt: skip
                except Exception as exc:  # recorded; the other kernels and modes still run
                    row.update(status="error", error=_error(exc))
                    result["errors"].append(f"{kernel} {mode} batch {b}: {row['error']}")
                result["rows"].append(row)
                print(f"  {kernel:>6} {mode:>6} batch {b:3d}: {_fmt(row.get('step_ms_median'))} ms/step "
                      f"{row['status']}", flush=True)  # fmt: skip
                _free()
    result["targets"] = step_targets(result["rows"], steps, batches)


def step_targets(rows: list[dict], steps: int, batches: list[int]) -> list[dict]:
    """Per kernel: the graph (or static) step ran every timed step (capture succeeded); per kernel and mode: the
    step at the largest batch <= 1.5x the step at the smallest."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for mode in ("graphs", "static"):
            mine = [r for r in rows if r["kernel"] == kernel and r["mode"] == mode]
            if mine:
                counter = "graph_replays" if mode == "graphs" else "static_decode_steps"
                done = [r for r in mine if r.get("status") == "ok"]
                value = None if len(done) < len(mine) else min(r[counter] / steps for r in done)
                out.append(target(f"{kernel}: {mode} steps / timed steps (every batch)", value, 1.0, ">="))
        if len(batches) > 1:
            lo, hi = min(batches), max(batches)
            for mode in dict.fromkeys(r["mode"] for r in ok if r["kernel"] == kernel):
                ms = {r["batch"]: r["step_ms_median"] for r in ok if r["kernel"] == kernel and r["mode"] == mode}
                value = ms[hi] / ms[lo] if lo in ms and hi in ms else None
                out.append(target(f"{kernel} {mode}: step at batch {hi} / step at batch {lo}", value, 1.5))
    return out


# ---------------------------------------------------------------------------------------------------- throughput
def stage_throughput(args, result: dict, out_dir: Path) -> None:
    """cr 1 / 4 / 8 with the unquantized pool, then cr 8 with the quantized pool at the same bytes (the fused
    dequantizing kernel under ``--decode-kernel auto`` on CUDA): one row per (rate, KV format)."""
    import bench_serving_throughput as bench

    p = PROFILES[args.device]["throughput"]
    base = ["--shape", p["shape"], "--device", args.device, "--dtype", PROFILES[args.device]["dtype"],
            "--lengths", *map(str, p["lengths"]), "--prompts", *map(str, p["prompts"]),
            "--output-tokens", str(p["output_tokens"]), "--fit", str(p["fit"]),
            "--min-cache-tokens", str(p["min_cache_tokens"]), "--protected-window", str(p["protected_window"]),
            "--decode-kernel", "auto", "--cuda-graphs" if args.device == "cuda" else "--static-decode"]  # fmt: skip
    runs = {"serving_throughput.json": [*base, "--rates", *map(str, p["rates"])]}
    if p["kv_quant"]:
        runs["serving_throughput_quant.json"] = [*base, "--rates", str(p["quant_rate"]), "--kv-quant", *p["kv_quant"]]
    result["settings"] = {"bench_args": list(runs.values())}
    result["shapes"] = {p["shape"]: bench.SHAPES[p["shape"]]}
    rows = []
    for name, argv in runs.items():
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            bench.main([*argv, "--out-dir", tmp])
            result["files"].append(_keep_json(Path(tmp), out_dir, name))
        rows += json.loads((out_dir / name).read_text())["rows"]
    keep = ("input_len", "compression_rate", "kv_quant", "prompts", "out_tok_per_s_wall", "decode_tok_per_s",
            "max_decode_batch", "mean_decode_batch", "preemptions", "decode_kernel", "graph_replays", "decode_steps",
            "wall_s")  # fmt: skip
    result["rows"] = [{k: r.get(k) for k in keep} for r in rows]
    result["targets"] = throughput_targets([r for r in rows if r.get("kv_quant", "none") == "none"])


def throughput_targets(rows: list[dict]) -> list[dict]:
    """Per input length: output tokens/s at cr 8 >= 3x cr 1 (same pool)."""
    out = []
    for length in dict.fromkeys(r["input_len"] for r in rows):
        tput = {r["compression_rate"]: r["out_tok_per_s_wall"] for r in rows if r["input_len"] == length}
        value = tput[8.0] / tput[1.0] if 1.0 in tput and 8.0 in tput and tput[1.0] else None
        out.append(target(f"throughput cr 8 / cr 1 ({length}-token prompts)", value, 3.0, ">="))
    return out


# ---------------------------------------------------------------------------------------------------- main
RUNNERS = {"tests": stage_tests, "kernels": stage_kernels, "methods": stage_methods, "step": stage_step,
           "throughput": stage_throughput}  # fmt: skip


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="+", metavar="STAGE", help=f"one or more of {', '.join(STAGES)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default: $OUT when set, else benchmarks/results/gpu_check/<stage>/")  # fmt: skip
    ap.add_argument("--methods", default=None, help="methods stage: comma list instead of bench_gpu's default set")
    ap.add_argument("--contexts", type=_csv_ints, default=None, help="methods stage: comma list of contexts")
    ap.add_argument("--batches", type=_csv_ints, default=None, help="methods and step stages: comma list")
    ap.add_argument("--steps", type=int, default=None, help="methods and step stages: timed decode steps")
    ap.add_argument("--kernels", default=None, help=f"step stage: comma list of {', '.join(STEP_KERNELS)}")
    ap.add_argument("--test-files", nargs="+", default=None, help="tests stage: instead of every CUDA test file")
    ap.add_argument("--sync-debug", choices=("error", "warn", "off"), default="error",
                    help="tests stage: torch.cuda.set_sync_debug_mode around decode forwards")  # fmt: skip
    ap.add_argument(
        "--limit-s",
        type=int,
        default=SUBPROCESS_LIMIT_S,
        help=f"tests and kernels stages: stop the pytest / benchmark run after this many seconds "
        f"(default {SUBPROCESS_LIMIT_S})",
    )
    ap.add_argument("--install-wheels", action="store_true",
                    help="tests stage: install pytest from .gpu/wheels even when this interpreter has it")  # fmt: skip
    args = ap.parse_args(argv)
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    if args.steps is not None and args.steps <= 0:
        ap.error(f"--steps must be positive, got {args.steps}")
    if args.kernels is not None:
        args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
        bad = [k for k in args.kernels if k not in STEP_KERNELS]
        if bad or not args.kernels:
            ap.error(f"--kernels takes a comma list of {', '.join(STEP_KERNELS)}; got {bad or 'nothing'}")
    return args


def run_stage(stage: str, args: argparse.Namespace) -> dict:
    """Run one stage, write its JSON and markdown, print its summary; returns the result (never raises for a
    failure inside the stage: it is recorded, and ``status`` says ``failed``)."""
    if args.out_dir is not None:
        out_dir = args.out_dir
    elif os.environ.get("OUT"):
        out_dir = Path(os.environ["OUT"])
    else:
        out_dir = RESULTS / stage
    out_dir.mkdir(parents=True, exist_ok=True)
    result = new_result(stage, args.device)
    t0 = time.perf_counter()
    print(f"== gpu_check {stage} on {result['device_name']} ({args.device}) -> {out_dir}", flush=True)
    try:
        RUNNERS[stage](args, result, out_dir)
    except Exception as exc:
        result["errors"].append(_error(exc))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if result["errors"]:
        result["status"] = "failed"
    write(result, out_dir)
    print(summary(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        # Triton kernels run under its interpreter on CPU tensors; it is read when triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(BENCH))
    results = [run_stage(stage, args) for stage in args.stages]
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
