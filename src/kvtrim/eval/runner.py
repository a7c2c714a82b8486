"""The sweep runner behind ``kvtrim eval``: tasks × methods × ratios (or budgets) on one model.

Layout of an output directory:

* ``records.jsonl``: one JSON object per (sample, method, ratio | budget, mode), appended and flushed as soon
  as it is produced (a crash loses at most the record in progress; a torn last line is dropped on restart).
* ``run.json``: the sweep configuration and environment of every invocation (``runs``), with wall times.
* ``summary.csv``: mean score ×100 per mode × task × length × method × ratio | budget, with ``n`` and mean
  sizes and timings (rebuilt from all records at the end of every sweep).

Protocol:

* Each sample is prefilled once per mode; that :class:`~kvtrim.api.Session` serves the full-cache run and every
  (method, ratio | budget), each compressing its own copy of the cache. The full-cache run is done once per
  sample and mode, and its score is copied into the compressed records (``full_score``).
* Context-only (default): the context is compressed, then the question (+ answer prefix) is appended, as
  kvpress and CriticalKV evaluate. Question-aware: context and question are prefilled and compressed together
  (the setting of most papers). ``mode`` and ``question_aware`` are recorded in every record.
* Resume: a deterministic key (task, index, method, ratio, budget, mode, length) identifies each record; keys
  already present in ``records.jsonl`` are skipped, and a sample whose every config is done is not prefilled.
* ``meta["stop_on_newline"]`` (needle, samsum): the prediction is cut at its first newline before scoring, as
  if generation had stopped on the newline token (the API strips leading whitespace from answers first).
  ``raw_prediction`` keeps the uncut text. ``meta["chat_template"]`` decides whether the model's chat template
  wraps the prompt. ``meta["secondary_metrics"]`` are scored into ``secondary_scores``.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import gzip
import json
import math
import os
import platform
import signal
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtrim.api import FULL, Session
from kvtrim.cache.quant import resolve_kv_quant
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import haystack_info
from kvtrim.eval.metrics import aggregate, metric_versions, score_sample
from kvtrim.eval.tasks import TASKS, Sample, generate_task
from kvtrim.methods import method_info
from kvtrim.prompts import check_prompt_format

__all__ = [
    "CONTEXT_ONLY",
    "QUESTION_AWARE",
    "RECORDS_FILE",
    "RUN_FILE",
    "SUMMARY_FILE",
    "environment",
    "load_records",
    "method_order",
    "record_key",
    "run_sweep",
    "summarize",
    "write_summary",
]

RECORDS_FILE = "records.jsonl"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.csv"
CONTEXT_ONLY = "context-only"
QUESTION_AWARE = "question-aware"
# Settings that must match the earlier runs recorded in the same directory.
_CONSISTENT = (
    "model", "seed", "haystack", "task_options", "max_new_tokens", "prefill_chunk", "prompt_format", "kv_quant",
)  # fmt: skip


# key group sizes a format name meant before int4's default became 64 tokens (records spelled it since)
_LEGACY_GROUP_SIZE = {"int8": 64, "int4": 32, "fp8": 64}


def _stored(name: str, value: Any) -> Any:
    """A setting as an earlier run recorded it, in today's terms: a ``kv_quant`` written before every setting was
    spelled out (``"int4"``, ``"int8:group_size=32"``) meant no full-precision window whatever the format and, for
    int4, key groups of 32 (``_LEGACY_GROUP_SIZE``); one written before ``sink`` existed
    (``"int4:group_size=32,residual=32"``) meant no sink, one written before ``rotate`` existed no rotation."""
    if name == "kv_quant" and isinstance(value, str):
        try:
            return resolve_kv_quant(
                value,
                default_group_size=_LEGACY_GROUP_SIZE.get(value.partition(":")[0]),
                default_residual=0,
                default_sink=0,
                default_rotate=False,
            ).spec
        except InvalidParameterError:
            return value
    return value


# ---------------------------------------------------------------------------------------------------- keys
def _num(value: float | int | None) -> str:
    return "-" if value is None else format(float(value), "g")


def record_key(record: dict[str, Any]) -> str:
    """The resume key of a record: ``task|index|method|ratio|budget|mode|length``."""
    return "|".join(
        [
            str(record["task"]),
            str(int(record["index"])),
            str(record["method"]),
            _num(record.get("ratio")),
            _num(record.get("budget")),
            str(record["mode"]),
            str(int(record["length"])),
        ]
    )


# ---------------------------------------------------------------------------------------------------- records io
def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``records.jsonl`` (or of the directory holding it); unparsable lines are skipped.

    A gzipped ``records.jsonl.gz`` beside it is read first: checked-in sweeps keep their records compressed, and a
    resumed sweep appends its new records to the plain file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS_FILE
    records: list[dict[str, Any]] = []
    archived = path.with_name(path.name + ".gz")
    for source, opener in ((archived, gzip.open), (path, open)):
        if not source.is_file():
            continue
        with opener(source, "rt", encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records


def _repair_records(path: Path) -> int:
    """Drop unparsable (torn) lines so appending stays valid JSONL; returns how many were dropped."""
    if not path.is_file():
        return 0
    raw = path.read_text(encoding="utf-8")
    lines = raw.splitlines()
    good = []
    for line in lines:
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            continue
        good.append(line)
    dropped = sum(1 for line in lines if line.strip()) - len(good)
    if dropped or (raw and not raw.endswith("\n")):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in good), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _clean(value: Any) -> Any:
    """NaN/inf floats become None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------- environment
def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every sweep."""
    import torch

    import kvtrim

    return {
        "kvtrim": kvtrim.__version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _model_info(model: Any) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    info: dict[str, Any] = {"class": type(model).__name__}
    for name in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size"):
        if cfg is not None and hasattr(cfg, name):
            info[name] = getattr(cfg, name)
    with contextlib.suppress(StopIteration, AttributeError, TypeError):
        info["dtype"] = str(next(model.parameters()).dtype)
    return info


# ---------------------------------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class _Config:
    method: str
    ratio: float | None
    budget: int | None


def _split_list(value: str | Sequence[Any] | None) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return list(value)


def _validate(
    tasks: list[str],
    methods: list[str],
    ratios: list[float],
    budgets: list[int],
    length: int,
    lengths: list[int],
    samples: int,
    task_options: dict[str, dict[str, Any]],
) -> None:
    if not tasks:
        raise InvalidParameterError("tasks: give at least one task")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise InvalidParameterError(f"tasks: unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise InvalidParameterError(f"tasks: duplicates in {tasks}")
    if FULL in methods:
        raise InvalidParameterError("methods: 'full' is always run as the reference; do not list it")
    for m in methods:
        method_info(m)
    if len(set(methods)) != len(methods):
        raise InvalidParameterError(f"methods: duplicates in {methods}")
    if methods and not ratios and not budgets:
        raise InvalidParameterError("give ratios and/or budgets for the methods")
    for r in ratios:
        BudgetSpec(ratio=r)
    for b in budgets:
        BudgetSpec(budget=b)
    if len(set(ratios)) != len(ratios) or len(set(budgets)) != len(budgets):
        raise InvalidParameterError("ratios/budgets: duplicates")
    for name, value in [("length", length), ("samples", samples), *[("lengths", x) for x in lengths]]:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidParameterError(f"{name}: expected a positive integer, got {value!r}")
    extra = sorted(set(task_options) - set(tasks))
    if extra:
        raise InvalidParameterError(f"task_options: given for task(s) {extra} that are not in the sweep")
    for name, opts in task_options.items():
        if not isinstance(opts, dict):
            raise InvalidParameterError(f"task_options[{name!r}]: expected a dict of options, got {opts!r}")


def _resolve_model(
    model: Any, model_label: str | None, device: str | None = None, dtype: str | None = None
) -> tuple[Any, Any, str]:
    """``model`` is a name (loaded with :func:`kvtrim.load_model` on ``device`` in ``dtype``) or a
    ``(model, tokenizer)`` pair."""
    if isinstance(model, str):
        from kvtrim.models import load_model

        lm, tok = load_model(model, dtype=dtype or "float32", device=device or "cpu")
        return lm, tok, model_label or model
    if isinstance(model, (tuple, list)) and len(model) == 2:
        lm, tok = model
        label = model_label or getattr(getattr(lm, "config", None), "_name_or_path", "") or type(lm).__name__
        return lm, tok, label
    raise InvalidParameterError(f"model: expected a model name or a (model, tokenizer) pair, got {type(model)}")


def _generate(
    tokenizer: Any,
    tasks: list[str],
    length: int,
    lengths: list[int],
    samples: int,
    seed: int,
    haystack: str | None,
    task_options: dict[str, dict[str, Any]],
) -> list[tuple[int, Sample]]:
    """All samples as ``(target length, sample)``; ``needle`` is generated for every length of ``lengths``."""
    out: list[tuple[int, Sample]] = []
    for task in tasks:
        opts = task_options.get(task, {})
        task_lengths = (lengths or [length]) if task == "needle" else [length]
        for target in task_lengths:
            for sample in generate_task(task, tokenizer, target, samples, seed=seed, haystack=haystack, **opts):
                out.append((target, sample))
    return out


def _cut_newline(prediction: str) -> str:
    return prediction.split("\n", 1)[0].rstrip()


class _HaystackInfo:
    """``haystack_info`` per haystack name, computed once (None for names it does not know)."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[str, Any] | None] = {}

    def __call__(self, name: Any) -> dict[str, Any] | None:
        if not isinstance(name, str):
            return None
        if name not in self._cache:
            try:
                self._cache[name] = haystack_info(name)
            except (ValueError, OSError):  # generated haystacks ("coded words", "needle", ...) are not files
                self._cache[name] = {"name": name, "source": "generated by the task"}
        return self._cache[name]


def _read_run_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"runs": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"{path} is not valid JSON ({exc}); move it away or use a fresh --out") from exc
    data.setdefault("runs", [])
    return data


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2, default=_json_default) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_sweep(
    model: Any,
    tasks: str | Sequence[str],
    methods: str | Sequence[str],
    ratios: str | Sequence[float] | None = None,
    length: int = 1024,
    samples: int = 20,
    question_aware: bool = False,
    out_dir: str | Path = "kvtrim-eval",
    seed: int = 42,
    budgets: str | Sequence[int] | None = None,
    haystack: str | None = None,
    task_options: dict[str, dict[str, Any]] | None = None,
    lengths: Sequence[int] | None = None,
    threads: int | None = None,
    model_label: str | None = None,
    max_new_tokens: int | None = None,
    progress: bool = True,
    prefill_chunk: int | None = None,
    prompt_format: str = "kvtrim",
    device: str | None = None,
    dtype: str | None = None,
    kv_quant: str | None = None,
) -> Path:
    """Run (or resume) a sweep and return ``out_dir`` (see the module docstring for the files written).

    Args:
        model: a model name for :func:`kvtrim.load_model`, or an already loaded ``(model, tokenizer)`` pair
        tasks, methods: names (lists or comma-separated strings); ``full`` is always added as the reference
        ratios: fractions of entries removed; budgets: entries kept per layer and KV head (either or both)
        length: target prompt length in tokens; ``lengths``: the length grid of the ``needle`` task
        samples: samples per task (for ``needle``: depths per length, evenly spaced over 0-100 %)
        question_aware: compress context and question together instead of the context alone
        task_options: per-task options for :func:`~kvtrim.eval.tasks.generate_task`, e.g. ``{"qa_1": {...}}``
        threads: ``torch.set_num_threads`` for the sweep (1 is much faster on a shared, busy CPU)
        model_label: the name recorded for a ``(model, tokenizer)`` pair
        max_new_tokens: cap on generated tokens (default: each task's own; for smoke tests only)
        progress: show tqdm progress bars
        prompt_format: the prompt layout, ``"kvtrim"`` or ``"kvpress"`` (see :mod:`kvtrim.prompts`); recorded in
            run.json and in every record, and one output directory holds one layout
        device, dtype: where and in which precision a model given by name is loaded (default cpu, float32)
        prefill_chunk: prefill every prompt this many tokens at a time, compressing between chunks (each method
            then prefills on its own); one output directory holds one setting
        kv_quant: hold every config's kept entries (the full cache's too) as ``"int8"``, ``"int4"`` or ``"fp8"``,
            or a spec string such as ``"int4:group_size=64"`` (docs/quantization.md); run.json and every record
            name it with every setting resolved (:attr:`~kvtrim.cache.quant.KVQuant.spec`, e.g. ``"int4:
            group_size=32,residual=32"``); one output directory holds one format
    """
    import torch

    started_wall = time.perf_counter()
    tasks_l = [str(t) for t in _split_list(tasks)]
    methods_l = [str(m) for m in _split_list(methods)]
    try:
        ratios_l = [float(r) for r in _split_list(ratios)]
        budgets_l = [int(b) for b in _split_list(budgets)]
        lengths_l = [int(x) for x in _split_list(lengths)]
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"ratios/budgets/lengths must be numbers ({exc})") from exc
    options = {k: dict(v) for k, v in (task_options or {}).items()}
    _validate(tasks_l, methods_l, ratios_l, budgets_l, length, lengths_l, samples, options)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
            raise InvalidParameterError(f"threads: expected a positive integer, got {threads!r}")
        torch.set_num_threads(threads)
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0
    ):
        raise InvalidParameterError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")

    check_prompt_format(prompt_format)
    quant = resolve_kv_quant(kv_quant)
    # recorded with every setting resolved: a later change of a format's defaults cannot mix two quantizations
    # under one name in a directory (the consistency check below compares this spec)
    kv_quant = None if quant is None else quant.spec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path, run_path = out / RECORDS_FILE, out / RUN_FILE
    run_data = _read_run_file(run_path)
    lm, tokenizer, label = _resolve_model(model, model_label, device, dtype)
    mode = QUESTION_AWARE if question_aware else CONTEXT_ONLY
    config = {
        "model": label,
        "tasks": tasks_l,
        "methods": methods_l,
        "ratios": ratios_l,
        "budgets": budgets_l,
        "length": length,
        "lengths": lengths_l,
        "samples": samples,
        "mode": mode,
        "question_aware": question_aware,
        "seed": seed,
        "haystack": haystack,
        "task_options": options,
        "threads": threads,
        "max_new_tokens": max_new_tokens,
        "prefill_chunk": prefill_chunk,
        "prompt_format": prompt_format,
        "kv_quant": kv_quant,
        "device": str(next(lm.parameters()).device),
        "dtype": str(next(lm.parameters()).dtype).removeprefix("torch."),
    }
    for previous in run_data["runs"]:
        for name in _CONSISTENT:
            if name in previous and _stored(name, previous[name]) != config[name]:
                raise InvalidParameterError(
                    f"{out} holds a sweep with {name}={previous[name]!r}, this one has {name}={config[name]!r}; "
                    "records would not be comparable: use another --out directory"
                )

    all_samples = _generate(tokenizer, tasks_l, length, lengths_l, samples, seed, haystack, options)
    configs = [_Config(FULL, None, None)]
    configs += [_Config(m, r, None) for m in methods_l for r in ratios_l]
    configs += [_Config(m, None, b) for m in methods_l for b in budgets_l]

    dropped = _repair_records(records_path)
    existing = load_records(records_path)
    done = {record_key(r) for r in existing}
    full_scores = {
        (r["task"], int(r["index"]), r["mode"], int(r["length"])): r.get("score")
        for r in existing
        if r.get("method") == FULL
    }

    def key_of(target: int, sample: Sample, cfg: _Config) -> str:
        return record_key(
            {
                "task": sample.task,
                "index": sample.index,
                "method": cfg.method,
                "ratio": cfg.ratio,
                "budget": cfg.budget,
                "mode": mode,
                "length": target,
            }
        )

    total = len(all_samples) * len(configs)
    skipped = sum(1 for target, s in all_samples for c in configs if key_of(target, s, c) in done)
    env = environment()
    run_entry: dict[str, Any] = {
        **config,
        "environment": env,
        "model_info": _model_info(lm),
        "metric_versions": metric_versions(),
        "records_planned": total,
        "records_skipped": skipped,
        "records_written": 0,
        "torn_lines_dropped": dropped,
        "started": _now(),
        "status": "running",
        "updated": None,
        "finished": None,
        "wall_s": None,
    }
    run_data["runs"].append(run_entry)
    _write_json(run_path, run_data)

    versions = {"kvtrim": env["kvtrim"], "torch": env["torch"], "transformers": env["transformers"]}
    m_versions = metric_versions()
    hay = _HaystackInfo()
    method_meta = {
        m: {"method_preset": method_info(m).preset, "method_params": method_info(m).defaults()} for m in methods_l
    }
    written = 0

    def checkpoint(status: str) -> None:
        run_entry.update(
            records_written=written,
            status=status,
            updated=_now(),
            wall_s=round(time.perf_counter() - started_wall, 2),
        )
        if status == "finished":
            run_entry["finished"] = run_entry["updated"]
        _write_json(run_path, run_data)

    previous_handler = _install_sigterm()
    status = "interrupted"
    bar = tqdm(total=total, initial=skipped, desc="kvtrim eval", unit="rec", disable=not progress, mininterval=2.0)
    try:
        with records_path.open("a", encoding="utf-8") as fh:
            for target, sample in all_samples:
                pending = [c for c in configs if key_of(target, sample, c) not in done]
                if not pending:
                    continue
                bar.set_postfix_str(f"{sample.task}#{sample.index} L={target}")
                session = Session(
                    lm,
                    tokenizer,
                    sample.context,
                    question=sample.question if question_aware else None,
                    methods=sorted({c.method for c in pending if c.method != FULL}),
                    answer_prefix=sample.answer_prefix or None,
                    use_chat_template=bool(sample.meta.get("chat_template", True)),
                    prefill_chunk=prefill_chunk,
                    prompt_format=prompt_format,
                )
                full_key = (sample.task, sample.index, mode, target)
                for cfg in pending:
                    record = _run_one(session, sample, cfg, question_aware, target, max_new_tokens, kv_quant)
                    if cfg.method == FULL:
                        full_scores[full_key] = record["score"]
                    record["full_score"] = full_scores.get(full_key)
                    record.update(method_meta.get(cfg.method, {"method_preset": None, "method_params": {}}))
                    record.update(
                        {
                            "model": label,
                            "haystack": sample.meta.get("haystack", haystack),
                            "haystack_info": hay(sample.meta.get("haystack", haystack)),
                            "versions": versions,
                            "metric_versions": m_versions,
                            "timestamp": _now(),
                        }
                    )
                    fh.write(json.dumps(_clean(record), default=_json_default) + "\n")
                    fh.flush()
                    done.add(record["key"])
                    written += 1
                    bar.update(1)
                checkpoint("running")  # run.json stays current even if the process is killed hard
        status = "finished"
    finally:
        bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        checkpoint(status)
        if records_path.is_file():
            write_summary(out)
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _install_sigterm() -> Any:
    """Turn SIGTERM into ``SystemExit`` so the sweep records its state before exiting (main thread only)."""
    try:
        return signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except ValueError:  # not the main thread
        return None


def _run_one(
    session: Session,
    sample: Sample,
    cfg: _Config,
    question_aware: bool,
    target: int,
    cap: int | None,
    kv_quant: str | None = None,
) -> dict[str, Any]:
    """Run one config on a prefilled session and build its record (model/version fields added by the caller)."""
    max_new = sample.max_new_tokens if cap is None else min(cap, sample.max_new_tokens)
    t0 = time.perf_counter()
    res = session.run(
        cfg.method,
        ratio=cfg.ratio,
        budget=cfg.budget,
        questions=None if question_aware else [sample.question],
        max_new_tokens=max_new,
        kv_quant=kv_quant,
    )
    run_s = time.perf_counter() - t0
    raw = res.answers[0]
    stop_nl = bool(sample.meta.get("stop_on_newline", False))
    prediction = _cut_newline(raw) if stop_nl else raw
    secondary_names = sample.meta.get("secondary_metrics", [])
    secondary = {name: score_sample(sample, prediction, metric=name) for name in secondary_names}
    stats = res.stats
    record: dict[str, Any] = {
        "task": sample.task,
        "index": sample.index,
        "seed": sample.seed,
        "length": target,
        "mode": CONTEXT_ONLY if not question_aware else QUESTION_AWARE,
        "question_aware": question_aware,
        "method": cfg.method,
        "ratio": cfg.ratio,
        "budget": cfg.budget,
        "prediction": prediction,
        "raw_prediction": raw,
        "answers": list(sample.answers),
        "metric": sample.metric,
        "score": score_sample(sample, prediction),
        "secondary_scores": secondary,
        "stop_on_newline": stop_nl,
        "chat_template": bool(sample.meta.get("chat_template", True)),
        "max_new_tokens": max_new,
        "context_tokens": stats.context_tokens,
        "kv_entries_before": stats.kv_entries_before,
        "kv_entries_after": stats.kv_entries_after,
        "kv_bytes_before": stats.kv_bytes_before,
        "kv_bytes_after": stats.kv_bytes_after,
        "kv_quant": kv_quant,
        "kept_fraction": stats.kept_fraction,
        "prefill_s": stats.prefill_s,
        "compress_s": stats.compress_s,
        "question_prefill_s": stats.question_prefill_s,
        "decode_s": stats.decode_s,
        "decode_tokens": stats.decode_tokens,
        "decode_ms_per_token": stats.decode_ms_per_token,
        "run_s": run_s,
        "layer_budgets": stats.layer_budgets,
        "peak_kv_bytes": stats.peak_kv_bytes,
        "compressions": stats.compressions,
        "prefill_chunk": stats.prefill_chunk,
        "compression_metadata": stats.compression_metadata,
        "prompt_format": stats.prompt_format,
        "separator": stats.separator,
        "meta": sample.meta,
    }
    record["key"] = record_key(record)
    return record


# ---------------------------------------------------------------------------------------------------- summary
DEFAULT_ORDER = ("full", "streaming_llm", "snapkv", "pyramidkv", "h2o", "knorm", "tova", "random")
"""Row order of methods in summaries and reports (others follow alphabetically)."""


def method_order(names: Iterable[str]) -> list[str]:
    """``full`` first, then the foundation order of :data:`DEFAULT_ORDER`, then the rest alphabetically."""
    order = {name: i for i, name in enumerate(DEFAULT_ORDER)}
    return sorted(set(names), key=lambda n: (n != FULL, order.get(n, len(order)), n))


def _mean(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(xs) if xs else None


def _sort_key(row: dict[str, Any], order: dict[str, int]) -> tuple:
    mode_rank = {CONTEXT_ONLY: 0, QUESTION_AWARE: 1}.get(row["mode"], 2)
    return (
        mode_rank,
        row["task"],
        row["length"],
        order.get(row["method"], len(order)),
        row["ratio"] is None and row["budget"] is not None,
        row["ratio"] if row["ratio"] is not None else -1.0,
        row["budget"] if row["budget"] is not None else -1,
    )


def summarize(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, task, length, method, ratio, budget): ``n``, ``score`` (mean ×100, 2 decimals),
    ``score_sem`` (standard error ×100), secondary scores ×100, ``full_score`` of the same samples, mean kept %,
    KV MiB after compression, compress ms, decode ms/token and prefill s."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = (r["mode"], r["task"], int(r["length"]), r["method"], r.get("ratio"), r.get("budget"))
        groups[key].append(r)
    order = {name: i for i, name in enumerate(method_order(k[3] for k in groups))}
    rows = []
    for (mode, task, length, method, ratio, budget), rs in groups.items():
        scores = [float(r["score"]) for r in rs]
        sem = statistics.stdev(scores) / math.sqrt(len(scores)) if len(scores) > 1 else None
        row: dict[str, Any] = {
            "mode": mode,
            "task": task,
            "length": length,
            "method": method,
            "ratio": ratio,
            "budget": budget,
            "n": len(rs),
            "score": aggregate(scores),
            "score_sem": None if sem is None else round(100 * sem, 2),
            "full_score": None,
            "kept_pct": None,
            "kv_mib": None,
            "compress_ms": None,
            "decode_ms_per_token": None,
            "prefill_s": None,
            "context_tokens": None,
        }
        fulls = [r.get("full_score") for r in rs]
        if fulls and all(f is not None for f in fulls):
            row["full_score"] = aggregate(float(f) for f in fulls)
        kept = _mean(r.get("kept_fraction") for r in rs)
        mib = _mean(r.get("kv_bytes_after") for r in rs)
        comp = _mean(r.get("compress_s") for r in rs)
        dec = _mean(r.get("decode_ms_per_token") for r in rs)
        pre = _mean(r.get("prefill_s") for r in rs)
        ctx = _mean(r.get("context_tokens") for r in rs)
        row["kept_pct"] = None if kept is None else round(100 * kept, 2)
        row["kv_mib"] = None if mib is None else round(mib / 2**20, 3)
        row["compress_ms"] = None if comp is None else round(1000 * comp, 2)
        row["decode_ms_per_token"] = None if dec is None else round(dec, 2)
        row["prefill_s"] = None if pre is None else round(pre, 3)
        row["context_tokens"] = None if ctx is None else round(ctx, 1)
        names = sorted({name for r in rs for name in (r.get("secondary_scores") or {})})
        for name in names:
            vals = [r["secondary_scores"][name] for r in rs if name in (r.get("secondary_scores") or {})]
            row[f"secondary:{name}"] = aggregate(vals)
        rows.append(row)
    rows.sort(key=lambda row: _sort_key(row, order))
    return rows


_SUMMARY_COLUMNS = [
    "mode",
    "task",
    "length",
    "method",
    "ratio",
    "budget",
    "n",
    "score",
    "score_sem",
    "full_score",
    "kept_pct",
    "kv_mib",
    "compress_ms",
    "decode_ms_per_token",
    "prefill_s",
    "context_tokens",
]


def write_summary(out_dir: str | Path) -> Path:
    """Rebuild ``summary.csv`` from ``records.jsonl`` in ``out_dir``; returns its path."""
    out = Path(out_dir)
    rows = summarize(load_records(out / RECORDS_FILE))
    extra = sorted({k for row in rows for k in row if k.startswith("secondary:")})
    path = out / SUMMARY_FILE
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=_SUMMARY_COLUMNS + extra, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in _SUMMARY_COLUMNS + extra})
    return path
