"""The ``kvtrim`` command line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import KVTrimError

app = typer.Typer(help="KV-cache compression for Hugging Face models.", no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Provision and list models.", no_args_is_help=True)
app.add_typer(models_app, name="models")
data_app = typer.Typer(help="Provision evaluation data (haystack texts).", no_args_is_help=True)
app.add_typer(data_app, name="data")


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2)


def _jsonable(value):
    return None if isinstance(value, float) and math.isnan(value) else value


DeviceOption = Annotated[str, typer.Option(help="device to load the model on: cpu, cuda, cuda:N, mps")]
DtypeOption = Annotated[str, typer.Option(help="model precision: float32, float16, bfloat16 or auto")]
PromptFormatOption = Annotated[
    str, typer.Option(help="prompt layout: kvtrim (context, blank line, question) or kvpress (kvpress's pipeline)")
]


@app.command()
def methods(
    list_: Annotated[bool, typer.Option("--list", help="one line per method: name and summary")] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="the README's method table: name, family, paper, capabilities")
    ] = False,
    write: Annotated[
        Path | None,
        typer.Option(help="with --markdown: replace the table between the methods-table markers in this file"),
    ] = None,
) -> None:
    """List the compression methods with their papers, defaults and capabilities."""
    from .methods import method_info, method_names

    if write is not None and not markdown:
        _fail(KVTrimError("--write needs --markdown"))
    if markdown:
        from .methods.table import markdown_table, write_table

        if write is None:
            typer.echo(markdown_table(), nl=False)
            return
        try:
            changed = write_table(write)
        except (KVTrimError, OSError) as exc:
            _fail(exc)
        typer.echo(f"{write}: method table {'updated' if changed else 'already up to date'}", err=True)
        return
    names = method_names()
    if list_:
        width = max(len(n) for n in names)
        for name in names:
            typer.echo(f"{name:<{width}}  {method_info(name).summary}")
        return
    for name in names:
        info = method_info(name)
        typer.echo(f"{name}\n    {info.summary}\n    paper:    {info.paper}\n    preset:   {info.preset}")
        typer.echo(f"    defaults: {info.defaults() or '{}'}")
        typer.echo(f"    family:   {info.family}; {', '.join(info.capabilities.labels())}")


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help="embedded model name")] = "smollm2-135m",
    force: Annotated[bool, typer.Option(help="re-download and re-convert")] = False,
) -> None:
    """Download and convert an embedded model into the kvtrim home (no-op when present)."""
    from .models import fetch_model

    try:
        path = fetch_model(name, force=force)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"{name}: {path}")


@models_app.command("list")
def models_list() -> None:
    """List embedded models and whether they are provisioned."""
    from .models import EMBEDDED_MODELS

    for spec in EMBEDDED_MODELS.values():
        state = "ready" if (spec.directory / "config.json").exists() else "not fetched"
        typer.echo(f"{spec.name:16s} {state:12s} {spec.description} (from {spec.wheel})")


@data_app.command("fetch")
def data_fetch(
    names: Annotated[list[str] | None, typer.Argument(help="haystacks to provision")] = None,
    force: Annotated[bool, typer.Option(help="rebuild even if cached")] = False,
) -> None:
    """Provision haystack texts into the kvtrim home (default: the Jargon File, from Debian's dict-jargon)."""
    from .eval.haystacks import fetch_haystack

    for name in names or ["jargon"]:
        try:
            path = fetch_haystack(name, force=force)
        except KVTrimError as exc:
            _fail(exc)
        typer.echo(f"{name}: {path}")


@app.command()
def generate(
    context_file: Annotated[Path, typer.Option("--context-file", help="text file holding the context")],
    question: Annotated[list[str], typer.Option("--question", help="a question (repeatable)")],
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    method: Annotated[
        str, typer.Option(help="method name (see `kvtrim methods`), optionally @schedule (snapkv@every:64), or 'full'")
    ] = "snapkv",
    ratio: Annotated[float | None, typer.Option(help="fraction of entries removed, in [0, 1)")] = None,
    budget: Annotated[int | None, typer.Option(help="entries kept per layer and KV head (> 0)")] = None,
    question_aware: Annotated[bool, typer.Option("--question-aware", help="compress context and question")] = False,
    answer_prefix: Annotated[str | None, typer.Option(help="text starting the answer")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate per question")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    prefill_chunk: Annotated[
        int | None, typer.Option(help="prefill in chunks of this many tokens, compressing between chunks")
    ] = None,
    prompt_format: PromptFormatOption = "kvtrim",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    do_sample: Annotated[
        bool | None, typer.Option("--do-sample/--greedy", help="sample (default: the model's generation config)")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature (> 0)")] = None,
    top_p: Annotated[float | None, typer.Option(help="nucleus sampling mass, in (0, 1]")] = None,
    top_k: Annotated[int | None, typer.Option(help="sample among the k likeliest tokens (0: all)")] = None,
    seed: Annotated[int | None, typer.Option(help="sampling seed (same seed, same answers)")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="string ending an answer (repeatable)")] = None,
    kv_quant: Annotated[
        str | None,
        typer.Option(
            "--kv-quant",
            help="hold the kept entries as int8, int4 or fp8, optionally with settings, e.g. int4:group_size=32; "
            "int4 means int4:group_size=64,residual=32,sink=1,rotate=1 (a 32-entry full-precision window, a "
            "one-entry sink, a rotated basis; docs/quantization.md)",
        ),
    ] = None,
) -> None:
    """Compress the context's KV cache and answer the question(s) from it."""
    from . import api
    from .cache.quant import resolve_kv_quant
    from .compression.compressor import BudgetSpec
    from .methods import get_method
    from .models import load_model, resolve_device, resolve_dtype
    from .prompts import check_prompt_format

    try:
        if method != api.FULL:
            spec = BudgetSpec(ratio=ratio, budget=budget)  # validate before loading anything
            get_method(method).check(spec.ratio, spec.budget)
        check_prompt_format(prompt_format)
        quant = resolve_kv_quant(kv_quant)
        kv_quant = None if quant is None else quant.spec  # named with every setting resolved in the output
        resolve_dtype(dtype), resolve_device(device)
        if not context_file.is_file():
            raise KVTrimError(f"--context-file {str(context_file)!r} does not exist")
        context = context_file.read_text(encoding="utf-8")
        lm, tokenizer = load_model(model, dtype=dtype, device=device)
        result = api.generate(
            lm,
            tokenizer,
            context,
            list(question),
            method=method,
            ratio=ratio,
            budget=budget,
            question_aware=question_aware,
            max_new_tokens=max_new_tokens,
            answer_prefix=answer_prefix,
            prefill_chunk=prefill_chunk,
            prompt_format=prompt_format,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop or None,
            kv_quant=kv_quant,
        )
    except (KVTrimError, ValueError) as exc:
        _fail(exc)
    s = result.stats
    if as_json:
        payload = {
            "answer": result.answers[0],
            "answers": result.answers,
            "method": s.method,
            "ratio": s.ratio,
            "budget": s.budget,
            "question_aware": s.question_aware,
            "context_tokens": s.context_tokens,
            "kv_entries_before": s.kv_entries_before,
            "kv_entries_after": s.kv_entries_after,
            "kv_bytes_before": s.kv_bytes_before,
            "kv_bytes_after": s.kv_bytes_after,
            "prefill_s": s.prefill_s,
            "compress_s": s.compress_s,
            "decode_ms_per_token": _jsonable(s.decode_ms_per_token),
            "peak_kv_bytes": s.peak_kv_bytes,
            "compressions": s.compressions,
            "prefill_chunk": s.prefill_chunk,
            "prompt_format": s.prompt_format,
            "kv_quant": kv_quant,
        }
        typer.echo(json.dumps(payload))
        return
    for q, a in zip(question, result.answers, strict=True):
        typer.echo(f"Q: {q}\nA: {a}")
    typer.echo(
        f"[{s.method} ratio={s.ratio} budget={s.budget}{f' kv_quant={kv_quant}' if kv_quant else ''}] "
        f"context {s.context_tokens} tokens; "
        f"KV {s.kv_entries_before} -> {s.kv_entries_after} entries, "
        f"{s.kv_bytes_before / 2**20:.2f} -> {s.kv_bytes_after / 2**20:.2f} MiB; "
        f"prefill {s.prefill_s:.2f}s, compress {1000 * s.compress_s:.1f} ms, "
        f"decode {s.decode_ms_per_token:.1f} ms/token"
    )


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="model to run")] = "smollm2-135m",
    samples: Annotated[int, typer.Option(help="prompts per task")] = 2,
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 1000,
    ratios: Annotated[str, typer.Option(help="comma-separated ratios")] = "0.5",
    methods_: Annotated[
        str | None, typer.Option("--methods", help="comma-separated methods (default: kvtrim.demo.DEFAULT_METHODS)")
    ] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    prompt_format: Annotated[
        str,
        typer.Option(help="prompt layout: kvpress (default: the full cache's best here) or kvtrim"),
    ] = "kvpress",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
) -> None:
    """Compress the embedded model's cache with several methods on passkey and needle prompts; print a table."""
    from .demo import run_demo

    try:
        if threads is not None:
            if threads <= 0:
                raise KVTrimError(f"--threads must be positive, got {threads}")
            import torch

            torch.set_num_threads(threads)
        run_demo(
            model=model,
            samples=samples,
            length=length,
            ratios=[float(r) for r in ratios.split(",")],
            methods=None if methods_ is None else [m.strip() for m in methods_.split(",") if m.strip()],
            device=device,
            dtype=dtype,
            prompt_format=prompt_format,
        )
    except (KVTrimError, ValueError) as exc:
        _fail(exc)


@app.command("eval")
def eval_command(
    tasks: Annotated[str, typer.Option(help="comma-separated task names (see kvtrim.eval.tasks)")],
    out: Annotated[Path, typer.Option(help="output directory (records.jsonl, run.json, summary.csv); resumable")],
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    methods_: Annotated[
        str, typer.Option("--methods", help="comma-separated methods (the full cache always runs too)")
    ] = "streaming_llm,snapkv,pyramidkv,adakv,critical_adakv,h2o,knorm,tova,random",
    ratios: Annotated[
        str | None, typer.Option(help="comma-separated fractions removed (default 0.5,0.75,0.9 unless --budgets)")
    ] = None,
    budgets: Annotated[str | None, typer.Option(help="comma-separated entries kept per layer and KV head")] = None,
    length: Annotated[int, typer.Option(help="target prompt length in tokens")] = 1024,
    lengths: Annotated[str | None, typer.Option(help="comma-separated length grid for the needle task")] = None,
    samples: Annotated[int, typer.Option(help="samples per task (needle: depths per length)")] = 20,
    question_aware: Annotated[
        bool, typer.Option("--question-aware", help="compress context and question together")
    ] = False,
    seed: Annotated[int, typer.Option(help="task generation seed")] = 42,
    haystack: Annotated[str | None, typer.Option(help="haystack for prose tasks (default: jargon)")] = None,
    task_options: Annotated[
        str | None, typer.Option(help='JSON per-task options, e.g. \'{"qa_1": {"squad_path": "dev.json"}}\'')
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads (1 is fastest on a busy CPU)")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="cap on generated tokens (smoke tests)")] = None,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
    prefill_chunk: Annotated[
        int | None, typer.Option(help="prefill in chunks of this many tokens, compressing between chunks")
    ] = None,
    prompt_format: PromptFormatOption = "kvtrim",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    kv_quant: Annotated[
        str | None,
        typer.Option(
            "--kv-quant",
            help="hold every config's entries as int8, int4 or fp8, optionally with settings, e.g. "
            "int4:residual=0,sink=0; int4 means int4:group_size=64,residual=32,sink=1,rotate=1 "
            "(docs/quantization.md); recorded with every setting resolved (one format per --out)",
        ),
    ] = None,
) -> None:
    """Sweep tasks × methods × ratios (or budgets) on one model; one JSONL record per sample and config."""
    from .eval.runner import run_sweep

    try:
        if ratios is None and budgets is None:
            ratios = "0.5,0.75,0.9"
        options = json.loads(task_options) if task_options else None
        if options is not None and not isinstance(options, dict):
            raise KVTrimError("--task-options must be a JSON object mapping task names to option objects")
        path = run_sweep(
            model,
            tasks,
            methods_,
            ratios,
            length=length,
            samples=samples,
            question_aware=question_aware,
            out_dir=out,
            seed=seed,
            budgets=budgets,
            haystack=haystack,
            task_options=options,
            lengths=[int(x) for x in lengths.split(",") if x.strip()] if lengths else None,
            threads=threads,
            max_new_tokens=max_new_tokens,
            progress=progress,
            prefill_chunk=prefill_chunk,
            prompt_format=prompt_format,
            device=device,
            dtype=dtype,
            kv_quant=kv_quant,
        )
    except (KVTrimError, ValueError, OSError) as exc:
        _fail(exc)
    typer.echo(f"records: {path / 'records.jsonl'}\nsummary: {path / 'summary.csv'}")


@app.command("report")
def report_command(
    out_dir: Annotated[Path, typer.Argument(help="the --out directory of `kvtrim eval`")],
    plots: Annotated[bool, typer.Option(help="write plots to DIR/plots")] = True,
) -> None:
    """Print the markdown table of a sweep (method × ratio per task) and write summary.md and plots."""
    from .eval.report import build_report

    try:
        text = build_report(out_dir, plots=plots)
    except (KVTrimError, ValueError, OSError) as exc:
        _fail(exc)
    typer.echo(text)


_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE_UNITS |= {f"{u}ib": 2 ** (10 * i) for i, u in enumerate("kmgt", 1)}
_SIZE_UNITS |= {f"{u}b": 1000**i for i, u in enumerate("kmgt", 1)}


def _parse_bytes(text: str) -> int:
    """``256MiB``, ``1GiB``, ``1.5G`` (binary), ``500MB`` (decimal) or a plain number of bytes."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or (value := float(match.group(1)) * _SIZE_UNITS[unit]) < 1:
        raise KVTrimError(f"--kv-memory must be a positive size such as 256MiB, 1GiB or 1000000 (bytes), got {text!r}")
    return int(value)


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    kv_memory: Annotated[
        str | None, typer.Option(help="KV cache pool size, e.g. 256MiB, 1GiB or bytes (default 256MiB)")
    ] = None,
    kv_blocks: Annotated[int | None, typer.Option(help="KV cache pool size in blocks (instead of --kv-memory)")] = None,
    compression_rate: Annotated[float, typer.Option(help="KV-Compress rate: 1 keeps everything, 8 keeps ~1/8")] = 1.0,
    method: Annotated[str, typer.Option(help="kvcompress | kvc_w8 | kvc_full")] = "kvcompress",
    block_size: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    protected_window: Annotated[
        int | None, typer.Option(help="newest tokens per head never evicted (default: the method's preset)")
    ] = None,
    max_batch: Annotated[int | None, typer.Option(help="running sequences at most (default: memory decides)")] = None,
    prefill_chunk: Annotated[int, typer.Option(help="prompt tokens per sequence per step (chunked prefill)")] = 512,
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens one step feeds, decodes included")] = 2048,
    decode_kernel: Annotated[
        str,
        typer.Option(
            help="decode attention: gather (gather + SDPA), flash (flash-attention block-table kernel, CUDA), "
            "triton (kvtrim's Triton block-table kernel, CUDA, any block size; with --kv-quant the fused "
            "dequantizing one) or auto"
        ),
    ] = "gather",
    decode_buckets: Annotated[bool, typer.Option(help="pad decode batches to static shapes")] = False,
    kv_quant: Annotated[
        str | None,
        typer.Option(
            "--kv-quant",
            help="hold the pool's K/V blocks packed as int8, int4 or fp8 with their scales, every entry packed when "
            "written (no full-precision window or sink, whatever the format; int4 rotated, int4:rotate=0 in the "
            "model's channels); --kv-memory counts packed bytes "
            "(docs/quantization.md)",
        ),
    ] = None,
    cuda_graphs: Annotated[
        bool, typer.Option(help="replay decode steps from CUDA graphs (CUDA; implies --decode-buckets)")
    ] = False,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    api_key: Annotated[
        str | None, typer.Option(envvar="KVTRIM_API_KEY", help="require 'Authorization: Bearer KEY' on /v1/*")
    ] = None,
    allowed_hosts: Annotated[
        list[str] | None, typer.Option(help="extra accepted Host names (repeatable; '*' accepts any)")
    ] = None,
    allowed_origins: Annotated[
        list[str] | None, typer.Option(help="browser origins allowed by CORS (repeatable; default: CORS off)")
    ] = None,
    max_request_bytes: Annotated[int, typer.Option(help="request body size limit (HTTP 413 beyond)")] = 1 << 20,
    max_prompts_per_request: Annotated[int, typer.Option(help="prompts in one completions request")] = 16,
    max_tokens: Annotated[int, typer.Option(help="largest max_tokens a request may ask for")] = 4096,
    max_prompt_chars: Annotated[int, typer.Option(help="characters of a prompt, checked before tokenizing")] = 100_000,
    shutdown_timeout: Annotated[
        float, typer.Option(help="seconds running requests get to finish after SIGTERM before they are aborted")
    ] = 5.0,
) -> None:
    """Serve a model with an OpenAI-compatible HTTP API (continuous batching over a paged, compressed KV cache)."""
    try:
        from .serve.http import serve as run_server
        from .serve.limits import ServerLimits
        from .serve.security import SecurityConfig
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        _fail(KVTrimError(f"the server needs the serve extra: pip install 'kvtrim[serve]' ({exc})"))
    from .models import load_model
    from .serve.engine import Engine

    try:
        if not shutdown_timeout >= 0:
            raise KVTrimError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
        limits = ServerLimits(
            max_request_bytes=max_request_bytes,
            max_prompts_per_request=max_prompts_per_request,
            max_tokens=max_tokens,
            max_prompt_chars=max_prompt_chars,
        )
        security = SecurityConfig.for_bind(host, api_key, tuple(allowed_hosts or ()), tuple(allowed_origins or ()))
        if kv_memory is not None and kv_blocks is not None:
            raise KVTrimError("give at most one of --kv-memory and --kv-blocks")
        kv_bytes = _parse_bytes(kv_memory or "256MiB") if kv_blocks is None else None
        from .cache.quantized_block_pool import pool_kv_quant

        quant = pool_kv_quant(kv_quant)  # a bad --kv-quant fails before the model loads
        kv_quant = None if quant is None else quant.spec  # the pool's settings, named in full in the banner
        if threads is not None:
            if threads <= 0:
                raise KVTrimError(f"--threads must be positive, got {threads}")
            import torch

            torch.set_num_threads(threads)
        lm, tokenizer = load_model(model, device=device, dtype=dtype)
        engine = Engine(
            lm,
            tokenizer,
            kv_memory_bytes=kv_bytes,
            kv_blocks=kv_blocks,
            block_size=block_size,
            compression_rate=compression_rate,
            method=method,
            protected_window=protected_window,
            max_batch=max_batch,
            model_name=model,
            prefill_chunk=prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_kernel=decode_kernel,
            decode_buckets=decode_buckets or cuda_graphs,
            cuda_graphs=cuda_graphs,
            kv_quant=kv_quant,
        )
    except (KVTrimError, ValueError) as exc:
        _fail(exc)
    typer.echo(
        f"kvtrim: serving {model} on http://{host}:{port}/v1 "
        f"(KV pool {engine.pool.num_blocks} blocks of {block_size} tokens"
        f"{f' packed as {kv_quant}' if kv_quant else ''}, compression rate {compression_rate:g}, "
        f"decode attention {engine.decode_kernel}{', CUDA graphs' if cuda_graphs else ''})",
        err=True,
    )
    try:
        run_server(
            engine, host=host, port=port, log_level=log_level, limits=limits, security=security,
            shutdown_timeout=shutdown_timeout,
        )  # fmt: skip
    except KVTrimError as exc:
        _fail(exc)
    import gc

    gc.freeze()  # the process ends now: the final collection over the model's objects took ~5 s under load


from .calibration.cli import calibrate_app  # noqa: E402

app.add_typer(calibrate_app, name="calibrate")

analyze_app = typer.Typer(help="Analyses reproduced from the papers.", no_args_is_help=True)
app.add_typer(analyze_app, name="analyze")


@analyze_app.command("perturbation")
def analyze_perturbation(
    out: Annotated[Path, typer.Option(help="output directory (json, md, plots)")],
    model: Annotated[str, typer.Option(help="model to analyse")] = "smollm2-135m",
    budgets: Annotated[str, typer.Option(help="comma-separated budgets per layer and KV head")] = "32,64,128",
    prompts: Annotated[int, typer.Option(help="number of prompts (Jargon File windows)")] = 4,
    context: Annotated[int, typer.Option(help="context tokens per prompt")] = 512,
    queries: Annotated[int, typer.Option(help="decoding queries compared")] = 16,
    baseline: Annotated[str, typer.Option(help="attention-only method")] = "snapkv",
    critical: Annotated[str, typer.Option(help="critical method")] = "critical_snapkv",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
) -> None:
    """CriticalKV's perturbation analysis: per-layer and per-head attention-output L1 perturbation of
    attention-only vs critical selection, and the share of heads where critical selection lowers it."""
    from .analysis.perturbation import perturbation_analysis, write_report
    from .models import load_model

    try:
        sizes = [int(b) for b in budgets.split(",")]
        if any(b <= 0 for b in sizes):
            raise KVTrimError(f"--budgets must be positive integers, got {budgets!r}")
        lm, tokenizer = load_model(model, dtype=dtype, device=device)
        report = perturbation_analysis(lm, tokenizer, sizes, prompts, context, queries, baseline, critical)
        files = write_report(report, out)
    except (KVTrimError, ValueError) as exc:
        _fail(exc)
    typer.echo((out / "perturbation.md").read_text())
    typer.echo("\n".join(str(f) for f in files))


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="kvtrim")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


@analyze_app.command("head-masking")
def analyze_head_masking(
    out: Annotated[Path, typer.Option(help="output directory (head_masking.json, head_masking.png)")],
    model: Annotated[str, typer.Option(help="model to analyse")] = "smollm2-135m",
    ks: Annotated[str, typer.Option(help="numbers of heads masked over the whole model, comma-separated")] = "5,10,20",
    tasks: Annotated[str, typer.Option(help="retrieval tasks, comma-separated")] = "passkey,niah_single_2",
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 1024,
    samples: Annotated[int, typer.Option(help="prompts per task")] = 10,
    seed: Annotated[int, typer.Option(help="task seed")] = 42,
    artifact: Annotated[Path | None, typer.Option(help="compresskv artifact (default: the model's)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
) -> None:
    """CompressKV's masking ablation: zero the top-k SRH, top-k TRH or k random query heads and measure retrieval
    accuracy with the full cache (needs the `compresskv` artifact)."""
    import torch

    from .analysis.head_masking import head_masking_analysis, write_report
    from .models import load_model

    try:
        sizes = [int(k) for k in ks.split(",") if k.strip()]
        if not sizes or any(k <= 0 for k in sizes):
            raise KVTrimError(f"--ks must be positive integers, got {ks!r}")
        if threads is not None:
            if threads <= 0:
                raise KVTrimError(f"--threads must be positive, got {threads}")
            torch.set_num_threads(threads)
        lm, tokenizer = load_model(model, dtype=dtype, device=device)
        task_list = [t.strip() for t in tasks.split(",") if t.strip()]
        report = head_masking_analysis(
            lm, tokenizer, sizes, task_list, length, samples, seed, artifact=artifact, progress=progress
        )
        files = write_report(report, out)
    except (KVTrimError, ValueError) as exc:
        _fail(exc)
    for name, acc in report.accuracy.items():
        typer.echo(f"{name:>12}: " + "  ".join(f"{task} {value:.2f}" for task, value in acc.items()))
    typer.echo("written: " + ", ".join(str(f) for f in files))
