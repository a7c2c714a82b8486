"""``kvtrim calibrate lukv``: the LU-KV budget-curve artifact (registered in :mod:`kvtrim.calibration.cli`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvtrim.calibration.qfilter_cli import DEFAULT_TASKS
from kvtrim.errors import KVTrimError


def lukv(
    model: Annotated[str, typer.Option(help="embedded name, local path or HF name")] = "smollm2-135m",
    tasks: Annotated[str, typer.Option(help="kvtrim tasks of the calibration prompts, comma-separated")] = (
        DEFAULT_TASKS
    ),
    samples: Annotated[int, typer.Option(help="prompts per task")] = 2,
    length: Annotated[int, typer.Option(help="prompt length in tokens")] = 1024,
    seed: Annotated[int, typer.Option(help="task seed (evaluation uses 42)")] = 1234,
    out: Annotated[Path | None, typer.Option(help="artifact root (default $KVTRIM_HOME/artifacts)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    progress: Annotated[bool, typer.Option(help="print progress")] = True,
) -> None:
    """LU-KV: per-head keep fractions for ratios 0.01..0.99 from the greedy marginal future utility of the `lukv`
    method's scorer on calibration prompts; saves the `lukv` artifact."""
    from kvtrim.artifacts.lukv import load_lukv_curves
    from kvtrim.calibration.cli import _fail, _load
    from kvtrim.calibration.lukv import LUKVCalibration, calibrate_lukv

    start = time.perf_counter()
    try:
        settings = LUKVCalibration(
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), samples=samples, length=length, seed=seed
        )
        mdl, tok = _load(model, threads)
        path = calibrate_lukv(mdl, tok, settings, out_dir=out, progress=progress)
        ratios, keep, _ = load_lukv_curves(mdl, path)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"lukv artifact: {path}")
    typer.echo(f"curves: {tuple(keep.shape)} over ratios {float(ratios[0]):.2f}..{float(ratios[-1]):.2f}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")
