"""``kvtrim calibrate qfilter``: the Q-Filters artifact (registered in :mod:`kvtrim.calibration.cli`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvtrim.errors import KVTrimError

# the default of kvtrim.calibration.qfilter.DEFAULT_TASKS, spelled here so that `kvtrim --help` imports no torch
DEFAULT_TASKS = "passkey,niah_single_2,niah_multikey_1,vt,fwe"


def qfilter(
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
    """Q-Filters: the principal direction of each (layer, KV head)'s queries on calibration prompts; saves the
    `qfilter` artifact."""
    from kvtrim.artifacts.qfilter import load_qfilters
    from kvtrim.calibration.cli import _fail, _load
    from kvtrim.calibration.qfilter import QFilterCalibration, calibrate_qfilter

    start = time.perf_counter()
    try:
        settings = QFilterCalibration(
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), samples=samples, length=length, seed=seed
        )
        mdl, tok = _load(model, threads)
        path = calibrate_qfilter(mdl, tok, settings, out_dir=out, progress=progress)
        filters, _ = load_qfilters(mdl, path)
    except KVTrimError as exc:
        _fail(exc)
    typer.echo(f"qfilter artifact: {path}")
    typer.echo(f"filters: {tuple(filters.shape)}")
    typer.echo(f"wall time: {time.perf_counter() - start:.1f} s")
