"""``kvtrim calibrate ...``: produce and inspect offline calibration artifacts.

Registered in the main CLI with ``app.add_typer(calibrate_app, name="calibrate")``; also runnable as
``python -m kvtrim.calibration.cli``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvtrim.errors import KVTrimError

# kvtrim.calibration.kvzip_targets.SYNTHETIC_TASKS, spelled here so that `kvtrim --help` imports no torch
SURROGATE_TASKS = "niah_single_1,niah_multikey_2,niah_multivalue,niah_single_3,passkey"

calibrate_app = typer.Typer(
    help="Produce and inspect offline calibration artifacts (keyed by the model's identity).",
    no_args_is_help=True,
    add_completion=False,
)


def _fail(exc: Exception | str) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2)


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        _fail(f"{what}={text!r}: expected comma-separated integers, e.g. 300,600,900,1200")
    if not values:
        _fail(f"{what}={text!r}: give at least one value")
    return values


def _load(model: str, threads: int | None, device: str = "cpu", dtype: str = "float32"):
    import torch

    from kvtrim.models import load_model

    if threads is not None:
        if threads <= 0:
            _fail(f"threads={threads}: expected a positive integer")
        torch.set_num_threads(threads)
    return load_model(model, dtype=dtype, device=device)


DeviceOption = Annotated[str, typer.Option(help="device to load the model on: cpu, cuda, cuda:N, mps")]
DtypeOption = Annotated[str, typer.Option(help="model precision: float32, float16, bfloat16 or auto")]
TargetsCacheOption = Annotated[
    str | None,
    typer.Option(help="where collected KVzip targets are kept for the next calibration ('' = nowhere; default "
    "$KVTRIM_HOME/kvzip_targets)"),
]


@calibrate_app.command("headkv")
def headkv(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    lengths: Annotated[str, typer.Option(help="context lengths in tokens, comma-separated")] = "300,600,900,1200",
    depths: Annotated[int, typer.Option(help="number of needle depths, round(linspace(0, 100, n))")] = 10,
    seed: Annotated[int, typer.Option(help="where in the haystack the contexts start (0: the beginning)")] = 0,
    min_f1: Annotated[float, typer.Option(help="keep tests whose QA-F1 exceeds this")] = 0.5,
    haystack: Annotated[str, typer.Option(help="haystack text: 'jargon', 'noise' or file:PATH")] = "jargon",
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Detect HeadKV retrieval-reasoning heads on needle tests and save the `headkv` artifact."""
    from kvtrim.artifacts.store import load_artifact
    from kvtrim.calibration.headkv import calibrate_headkv

    grid = _parse_ints(lengths, "lengths")
    start = time.perf_counter()
    try:
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_headkv(
            mdl,
            tok,
            lengths=grid,
            depths=depths,
            seed=seed,
            out_dir=out,
            min_f1=min_f1,
            haystack=haystack,
            progress=progress,
        )
        summary = load_artifact("headkv", mdl, path).meta.get("summary", {})
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"headkv artifact: {path}")
    typer.echo(f"tests kept: {summary.get('kept')}/{summary.get('tests')} (per kind: {summary.get('kept_by_kind')})")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("compresskv")
def compresskv(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    lengths: Annotated[
        str, typer.Option(help="needle context lengths in tokens, comma-separated")
    ] = "300,600,900,1200",
    depths: Annotated[int, typer.Option(help="number of needle depths, round(linspace(0, 100, n))")] = 10,
    needles: Annotated[int | None, typer.Option(help="use the first N built-in needles (default: all 4)")] = None,
    seed: Annotated[int, typer.Option(help="where in the haystack the contexts start (0: the beginning)")] = 0,
    min_recall: Annotated[float, typer.Option(help="a needle test counts when ROUGE-1 recall exceeds this")] = 0.5,
    max_new_tokens: Annotated[int, typer.Option(help="greedy decoding steps per needle test")] = 50,
    haystack: Annotated[str, typer.Option(help="haystack text: 'jargon', 'noise' or file:PATH")] = "jargon",
    tasks: Annotated[
        str, typer.Option(help="layer-profile tasks (kvtrim eval task names), comma-separated")
    ] = "passkey,niah_single_1,niah_single_2,niah_multikey_1,vt,fwe",
    task_samples: Annotated[int, typer.Option(help="layer-profile prompts per task")] = 4,
    task_length: Annotated[int, typer.Option(help="layer-profile prompt length in tokens")] = 1024,
    task_seed: Annotated[int, typer.Option(help="layer-profile task seed (evaluation uses 42)")] = 1234,
    heads_per_layer: Annotated[int, typer.Option(help="SRH heads per layer used by the layer profile")] = 4,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """CompressKV: SRH/TRH head scores on needle tests and the error-aware layer profile; saves `compresskv`."""
    from kvtrim.calibration.compresskv import DEFAULT_NEEDLES, calibrate_compresskv, load_compresskv

    grid = _parse_ints(lengths, "lengths")
    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_list:
        _fail(f"tasks={tasks!r}: give at least one task")
    if needles is not None and not 1 <= needles <= len(DEFAULT_NEEDLES):
        _fail(f"needles={needles}: choose 1..{len(DEFAULT_NEEDLES)}")
    start = time.perf_counter()
    try:
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_compresskv(
            mdl,
            tok,
            lengths=grid,
            depths=depths,
            needles=DEFAULT_NEEDLES[: needles or len(DEFAULT_NEEDLES)],
            haystack=haystack,
            seed=seed,
            min_recall=min_recall,
            max_new_tokens=max_new_tokens,
            tasks=task_list,
            task_samples=task_samples,
            task_length=task_length,
            task_seed=task_seed,
            heads_per_layer=heads_per_layer,
            out_dir=out,
            progress=progress,
        )
        summary = load_compresskv(mdl, path).meta.get("summary", {})
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"compresskv artifact: {path}")
    typer.echo(f"needle tests succeeded: {summary.get('successes')}/{summary.get('tests')}")
    typer.echo(
        f"layer profile prompts: {summary.get('profile_prompts')} ({', '.join(summary.get('profile_tasks', []))})"
    )
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("compilerkv")
def compilerkv(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    budgets: Annotated[str, typer.Option(help="budgets to compile (entries per layer), comma-separated")] = (
        "64,128,256"
    ),
    documents: Annotated[int, typer.Option(help="calibration prompts")] = 32,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length T in tokens")] = 1000,
    continuation_tokens: Annotated[int, typer.Option(help="continuation tokens scored by the NLL")] = 128,
    head_rollouts: Annotated[int, typer.Option(help="random joint head-weight actions per document and budget")] = 10,
    gate_rollouts: Annotated[int, typer.Option(help="random joint threshold actions per document and budget")] = 6,
    rounds: Annotated[int, typer.Option(help="head/gate alternations (stops early when both policies hold)")] = 1,
    corpus: Annotated[str, typer.Option(help="'pydoc' (CPython's bundled docs) or a directory of .txt/.md")] = "pydoc",
    seed: Annotated[int, typer.Option(help="document order and action logging seed")] = 1234,
    epochs: Annotated[int, typer.Option(help="CQL epochs")] = 60,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="print progress to stderr")] = True,
) -> None:
    """CompilerKV: collect rollouts on a calibration corpus and compile the head and threshold tables with CQL."""
    from kvtrim.artifacts.compilerkv import load_compilerkv
    from kvtrim.calibration.compilerkv import CompilerKVCalibration, calibrate_compilerkv
    from kvtrim.calibration.cql import CQLSettings

    start = time.perf_counter()
    try:
        settings = CompilerKVCalibration(
            budgets=tuple(_parse_ints(budgets, "budgets")),
            documents=documents,
            prompt_tokens=prompt_tokens,
            continuation_tokens=continuation_tokens,
            head_rollouts=head_rollouts,
            gate_rollouts=gate_rollouts,
            rounds=rounds,
            corpus=corpus,
            seed=seed,
            cql=CQLSettings(epochs=epochs),
        )
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_compilerkv(mdl, tok, settings, out_dir=out, progress=progress)
        tables = load_compilerkv(mdl, str(path))
    except KVTrimError as exc:
        _fail(exc)
    summary = tables.meta.get("summary", {})
    typer.echo(f"compilerkv artifact: {path}")
    typer.echo(
        f"rollouts: {summary.get('rollouts')}; head states visited {summary.get('head_states_visited')}; "
        f"gate states visited {summary.get('gate_states_visited')}/{summary.get('gate_states')}"
    )
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("duo")
def duo(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    samples: Annotated[int, typer.Option(help="synthetic passkey prompts")] = 8,
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 1024,
    sink: Annotated[int, typer.Option(help="streaming heads' attention sinks (tokens)")] = 16,
    recent: Annotated[int, typer.Option(help="streaming heads' recent window (tokens)")] = 48,
    answer_window: Annotated[int, typer.Option(help="last positions the deviation is averaged over")] = 32,
    seed: Annotated[int, typer.Option(help="passkey task seed (evaluation uses 42)")] = 1234,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """DuoAttention: rank (layer, KV head) pairs by how much streaming them changes the attention output on
    passkey prompts; saves the `duo` artifact of head gates."""
    from kvtrim.budgets.duo_heads import load_duo_gates
    from kvtrim.calibration.duo import DuoCalibration, calibrate_duo

    start = time.perf_counter()
    try:
        settings = DuoCalibration(
            samples=samples, length=length, sink=sink, recent=recent, answer_window=answer_window, seed=seed
        )
        mdl, tok = _load(model, threads)
        path = calibrate_duo(mdl, tok, settings, out_dir=out, progress=progress)
        gates, _ = load_duo_gates(mdl, path)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"duo artifact: {path}")
    typer.echo(f"gates: {tuple(gates.shape)}, {int((gates >= 0.5).sum())} heads at or above 0.5")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


def _prompt_settings(prompts, heldout, length, seed, tasks: str, pydoc, tokens_per_prompt=None):
    """The calibration prompts of the surrogate and statistics commands (``tasks``: comma-separated families)."""
    from kvtrim.calibration.kvzip_targets import TargetSettings

    extra = {} if tokens_per_prompt is None else {"tokens_per_prompt": tokens_per_prompt}
    families = tuple(t.strip() for t in tasks.split(",") if t.strip())
    return TargetSettings(
        prompts=prompts, heldout=heldout, length=length, seed=seed, tasks=families, pydoc=pydoc, **extra
    )


@calibrate_app.command("kvzap")
def kvzap(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    prompts: Annotated[int, typer.Option(help="training prompts (pydoc prose and synthetic tasks, alternating)")] = 16,
    heldout: Annotated[int, typer.Option(help="held-out prompts the fit is measured on")] = 4,
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 768,
    tokens_per_prompt: Annotated[int, typer.Option(help="training tokens drawn from each prompt")] = 512,
    tasks: Annotated[str, typer.Option(help="synthetic task families, comma-separated ('' for prose only)")] = (
        SURROGATE_TASKS
    ),
    pydoc: Annotated[bool, typer.Option(help="every other prompt a window of CPython's bundled prose")] = True,
    hidden_dim: Annotated[int, typer.Option(help="the MLP surrogate's hidden width")] = 64,
    epochs: Annotated[int, typer.Option(help="MLP training epochs")] = 10,
    ridge: Annotated[float, typer.Option(help="the linear surrogate's L2 penalty")] = 1.0,
    seed: Annotated[int, typer.Option(help="prompt choice, task samples, token sampling (evaluation: 42)")] = 1234,
    targets_cache: TargetsCacheOption = None,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """KVzap: fit linear and MLP surrogates of KVzip's scores from hidden states; saves the `kvzap` artifact."""
    from kvtrim.artifacts.store import load_artifact
    from kvtrim.calibration.kvzap import KVzapCalibration, calibrate_kvzap

    start = time.perf_counter()
    try:
        settings = KVzapCalibration(
            targets=_prompt_settings(prompts, heldout, length, seed, tasks, pydoc, tokens_per_prompt),
            ridge=ridge,
            hidden_dim=hidden_dim,
            epochs=epochs,
        )
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_kvzap(mdl, tok, settings, out_dir=out, progress=progress, targets_cache=targets_cache)
        summary = load_artifact("kvzap", mdl, path).meta.get("summary", {})
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"kvzap artifact: {path}")
    typer.echo(f"training tokens: {summary.get('training_tokens')}")
    for kind in ("linear", "mlp"):
        if f"heldout_{kind}" in summary:
            typer.echo(f"held-out {kind}: {summary[f'heldout_{kind}']}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("fastkvzip")
def fastkvzip(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    prompts: Annotated[int, typer.Option(help="training prompts (pydoc prose and synthetic tasks, alternating)")] = 16,
    heldout: Annotated[int, typer.Option(help="held-out prompts the fit is measured on")] = 4,
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 768,
    tokens_per_prompt: Annotated[int, typer.Option(help="training tokens drawn from each prompt")] = 512,
    tasks: Annotated[str, typer.Option(help="synthetic task families, comma-separated ('' for prose only)")] = (
        SURROGATE_TASKS
    ),
    pydoc: Annotated[bool, typer.Option(help="every other prompt a window of CPython's bundled prose")] = True,
    width: Annotated[int, typer.Option(help="the gate queries' and keys' width")] = 16,
    sinks: Annotated[int, typer.Option(help="learned sink keys per KV head")] = 16,
    epochs: Annotated[int, typer.Option(help="training epochs")] = 10,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-2,
    seed: Annotated[int, typer.Option(help="prompt choice, task samples, token sampling (evaluation: 42)")] = 1234,
    targets_cache: TargetsCacheOption = None,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """Fast KVzip: train gates predicting KVzip's scores from hidden states; saves the `fastkvzip` artifact (the
    KVzip targets are shared with `kvtrim calibrate kvzap` through the targets cache)."""
    from kvtrim.artifacts.store import load_artifact
    from kvtrim.calibration.fastkvzip import FastKVzipCalibration, calibrate_fastkvzip

    start = time.perf_counter()
    try:
        settings = FastKVzipCalibration(
            targets=_prompt_settings(prompts, heldout, length, seed, tasks, pydoc, tokens_per_prompt),
            width=width,
            sinks=sinks,
            epochs=epochs,
            lr=lr,
        )
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_fastkvzip(mdl, tok, settings, out_dir=out, progress=progress, targets_cache=targets_cache)
        summary = load_artifact("fastkvzip", mdl, path).meta.get("summary", {})
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"fastkvzip artifact: {path}")
    typer.echo(f"training tokens: {summary.get('training_tokens')} (targets cached: {summary.get('targets_cached')})")
    if "heldout_gate" in summary:
        typer.echo(f"held-out gate: {summary['heldout_gate']}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("restorekv")
def restorekv(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    prompts: Annotated[int, typer.Option(help="training prompts (pydoc prose and synthetic tasks, alternating)")] = 24,
    heldout: Annotated[int, typer.Option(help="held-out prompts the KL is measured on")] = 4,
    length: Annotated[int, typer.Option(help="context tokens of a prompt")] = 320,
    continuation: Annotated[int, typer.Option(help="tokens after the context the KL is measured on")] = 32,
    tokens: Annotated[int, typer.Option(help="restore tokens")] = 8,
    rank: Annotated[int, typer.Option(help="rank of the attention adapter")] = 8,
    targets: Annotated[str, typer.Option(help="adapted projections, comma-separated (of q,k,v,o)")] = "q,k,v,o",
    ratios: Annotated[str, typer.Option(help="compression ratios the steps cycle through")] = "0.75,0.875",
    steps: Annotated[int, typer.Option(help="training steps (one prompt each)")] = 120,
    lr: Annotated[float, typer.Option(help="Adam learning rate (cosine decay)")] = 5e-3,
    tasks: Annotated[str, typer.Option(help="synthetic task families, comma-separated ('' for prose only)")] = (
        SURROGATE_TASKS
    ),
    pydoc: Annotated[bool, typer.Option(help="every other prompt a window of CPython's bundled prose")] = True,
    seed: Annotated[int, typer.Option(help="prompt choice, task samples, initialisation (evaluation: 42)")] = 1234,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """RestoreKV: train restore-token embeddings and an attention LoRA by self-distillation from the full-cache
    model (KVzip evicting, weights frozen); saves the `restorekv` artifact."""
    from kvtrim.artifacts.store import load_artifact
    from kvtrim.calibration.restorekv import RestoreKVCalibration, calibrate_restorekv

    start = time.perf_counter()
    try:
        ratio_values = tuple(float(x) for x in ratios.replace(" ", "").split(",") if x)
    except ValueError:
        _fail(f"ratios={ratios!r}: expected comma-separated numbers in (0, 1), e.g. 0.75,0.875")
    try:
        settings = RestoreKVCalibration(
            prompts=prompts,
            heldout=heldout,
            length=length,
            continuation=continuation,
            tokens=tokens,
            rank=rank,
            targets=tuple(t for t in targets.replace(" ", "").split(",") if t),
            ratios=ratio_values,
            steps=steps,
            lr=lr,
            seed=seed,
            tasks=tuple(t for t in tasks.replace(" ", "").split(",") if t),
            pydoc=pydoc,
        )
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_restorekv(mdl, tok, settings, out_dir=out, progress=progress)
        summary = load_artifact("restorekv", mdl, path).meta.get("summary", {})
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"restorekv artifact: {path}")
    typer.echo(f"training KL: first steps {summary.get('first_steps_kl')}, last steps {summary.get('last_steps_kl')}")
    for ratio, fit in summary.get("heldout_kl", {}).items():
        typer.echo(f"held-out KL at ratio {ratio}: restorekv {fit['restorekv_kl']}, kvzip {fit['kvzip_kl']}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("expected_attention_stats")
def expected_attention_stats(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    prompts: Annotated[int, typer.Option(help="calibration prompts (pydoc prose and synthetic tasks, alternating)")] = (
        16
    ),
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 768,
    tasks: Annotated[str, typer.Option(help="synthetic task families, comma-separated ('' for prose only)")] = (
        SURROGATE_TASKS
    ),
    pydoc: Annotated[bool, typer.Option(help="every other prompt a window of CPython's bundled prose")] = True,
    n_sink: Annotated[int, typer.Option(help="first positions left out of the statistics")] = 4,
    seed: Annotated[int, typer.Option(help="prompt choice and task samples (evaluation: 42)")] = 1234,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """Expected Attention: each layer's pre-RoPE query mean and covariance over calibration prompts; saves the
    `expected_attention_stats` artifact."""
    from kvtrim.calibration.query_stats import QueryStatsCalibration, calibrate_query_stats

    start = time.perf_counter()
    try:
        settings = QueryStatsCalibration(
            prompts=_prompt_settings(prompts, 0, length, seed, tasks, pydoc),
            n_sink=n_sink,
        )
        mdl, tok = _load(model, threads, device, dtype)
        path = calibrate_query_stats(mdl, tok, settings, out_dir=out, progress=progress)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"expected_attention_stats artifact: {path}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")


@calibrate_app.command("show")
def show(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    kind: Annotated[str, typer.Option(help="artifact kind (headkv, compresskv, duo, kvzap, ...)")] = "headkv",
    path: Annotated[Path | None, typer.Option(help="artifact file or directory (default: search)")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a layer x head heatmap (PNG)")] = None,
    tensor: Annotated[str | None, typer.Option(help="tensor to plot (default: the artifact's primary one)")] = None,
) -> None:
    """Print a summary of an artifact; optionally plot one of its layer x head tensors."""
    from kvtrim.artifacts.store import describe_artifact, load_artifact

    try:
        mdl, _ = _load(model, None)
        artifact = load_artifact(kind, mdl, path)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(describe_artifact(artifact))
    if plot is not None and kind == "compilerkv" and tensor is None:
        from kvtrim.artifacts.compilerkv import CompiledTables, plot_compilerkv

        try:
            plot_compilerkv(CompiledTables.from_tensors(artifact.tensors, artifact.meta), plot)
        except ImportError:
            _fail("--plot needs matplotlib (pip install 'kvtrim[eval]')")
        typer.echo(f"policy plots: {plot}")
        return
    if plot is not None and kind == "compresskv" and tensor is None:
        from kvtrim.calibration.compresskv import plot_compresskv

        try:
            plot_compresskv(artifact, plot)
        except ImportError:
            _fail("--plot needs matplotlib (pip install 'kvtrim[eval]')")
        except KeyError as exc:
            _fail(f"the artifact lacks tensor {exc}")
        typer.echo(f"heatmap: {plot}")
        return
    if plot is not None:
        names = [n for n, t in artifact.tensors.items() if t.dim() == 2]
        name = tensor or artifact.meta.get("primary_tensor") or (names[0] if names else None)
        if name is None or name not in artifact.tensors or artifact.tensors[name].dim() != 2:
            _fail(f"tensor={name!r}: choose a 2-D tensor of this artifact ({names})")
        _heatmap(artifact.tensors[name], f"{artifact.meta.get('model_key')}  {kind}:{name}", plot)
        typer.echo(f"heatmap: {plot}")


def _heatmap(values, title: str, target: Path) -> None:
    """Layer (rows) x head (columns) heatmap with matplotlib's Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("--plot needs matplotlib (pip install 'kvtrim[eval]')")
    data = values.float().numpy()
    rows, cols = data.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * cols + 2.0), max(4.0, 0.22 * rows + 1.5)))
    image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(cols))
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)


# Calibrations whose commands live in their own modules.
from .lukv_cli import lukv as _lukv  # noqa: E402
from .qfilter_cli import qfilter as _qfilter  # noqa: E402

calibrate_app.command("qfilter")(_qfilter)
calibrate_app.command("lukv")(_lukv)


if __name__ == "__main__":  # pragma: no cover
    calibrate_app()
