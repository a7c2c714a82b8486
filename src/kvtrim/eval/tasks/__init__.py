"""Synthetic long-context tasks: the registry and :func:`generate_task`.

Every generator is offline and seeded, and fits each sample to a target length measured in tokens of
the given tokenizer (see :func:`~kvtrim.eval.tasks.base.length_tolerance`).
"""

from __future__ import annotations

import inspect
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.tasks.base import Sample, TaskSpec, length_tolerance
from kvtrim.eval.tasks.long_copy import LONG_COPY_ITEMS, LONG_COPY_MAX_NEW_TOKENS, generate_long_copy
from kvtrim.eval.tasks.needle import NEEDLE_MAX_NEW_TOKENS, generate_needle, needle_grid
from kvtrim.eval.tasks.passkey import generate_passkey
from kvtrim.eval.tasks.qa import generate_qa
from kvtrim.eval.tasks.ruler import (
    NIAH_CONFIGS,
    RULER_MAX_NEW_TOKENS,
    generate_cwe,
    generate_fwe,
    generate_niah,
    generate_vt,
)

__all__ = [
    "RULER_TASKS",
    "TASKS",
    "Sample",
    "TaskSpec",
    "generate_task",
    "length_tolerance",
    "list_tasks",
    "needle_grid",
]

_NIAH_DESCRIPTIONS = {
    "niah_single_1": "RULER NIAH: one word key, 7-digit value, noise haystack (passkey-like)",
    "niah_single_2": "RULER NIAH: one word key, 7-digit value, prose haystack",
    "niah_single_3": "RULER NIAH: one word key, UUID value, prose haystack",
    "niah_multikey_1": "RULER NIAH: 4 keys (3 distractor needles), 7-digit value, prose haystack",
    "niah_multikey_2": "RULER NIAH: one word key in a haystack made of distractor needles",
    "niah_multikey_3": "RULER NIAH: one UUID key, UUID value, haystack of distractor needles",
    "niah_multivalue": "RULER NIAH: one word key with 4 values to recall, prose haystack",
    "niah_multiquery": "RULER NIAH: 4 keys, all 4 values to recall, prose haystack",
}


def _build_registry() -> dict[str, TaskSpec]:
    tasks: dict[str, TaskSpec] = {}
    for name, cfg in NIAH_CONFIGS.items():
        tasks[name] = TaskSpec(
            name=name,
            description=_NIAH_DESCRIPTIONS[name],
            generate=generate_niah,
            metric="string_match_all",
            max_new_tokens=RULER_MAX_NEW_TOKENS["niah"],
            family="ruler",
            uses_haystack=cfg.haystack == "essay",
        )
    tasks["vt"] = TaskSpec(
        "vt",
        "RULER variable tracking: 1 chain, 4 hops, among noise lines (one-shot demo)",
        generate_vt,
        "string_match_all",
        RULER_MAX_NEW_TOKENS["vt"],
        "ruler",
    )
    tasks["cwe"] = TaskSpec(
        "cwe",
        "RULER common words extraction: the 10 most frequent words of a numbered list",
        generate_cwe,
        "string_match_all",
        RULER_MAX_NEW_TOKENS["cwe"],
        "ruler",
    )
    tasks["fwe"] = TaskSpec(
        "fwe",
        "RULER frequent words extraction: top-3 coded words under a Zipf(2) distribution",
        generate_fwe,
        "string_match_all",
        RULER_MAX_NEW_TOKENS["fwe"],
        "ruler",
    )
    tasks["qa_1"] = TaskSpec(
        "qa_1",
        "RULER QA over SQuAD v2.0 dev paragraphs (needs squad_path)",
        generate_qa,
        "string_match_part",
        RULER_MAX_NEW_TOKENS["qa"],
        "ruler",
        options=("squad_path",),
    )
    tasks["qa_2"] = TaskSpec(
        "qa_2",
        "RULER multi-hop QA over HotpotQA dev-distractor (needs hotpotqa_path)",
        generate_qa,
        "string_match_part",
        RULER_MAX_NEW_TOKENS["qa"],
        "ruler",
        options=("hotpotqa_path",),
    )
    tasks["passkey"] = TaskSpec(
        "passkey",
        "Passkey retrieval (Landmark/LongLoRA format), key in 1..50000",
        generate_passkey,
        "passkey_match",
        10,
        "passkey",
        options=("depth",),
    )
    tasks["passkey_64"] = TaskSpec(
        "passkey_64",
        "Passkey retrieval with a 64-digit key (LagKV setting); exact and per-digit scores",
        generate_passkey,
        "passkey_match",
        72,
        "passkey",
        options=("depth",),
    )
    tasks["needle"] = TaskSpec(
        "needle",
        "Needle-in-a-Haystack, KV-compression-paper variant (completion prompt, word recall)",
        generate_needle,
        "needle_recall",
        NEEDLE_MAX_NEW_TOKENS,
        "needle",
        options=("depths",),
        uses_haystack=True,
    )
    tasks["long_copy"] = TaskSpec(
        "long_copy",
        f"Long-output copying: write out a hidden list of {LONG_COPY_ITEMS} 'word: code' items in order (noise "
        "haystack; ~150-300 answer tokens, for decoding-time compression); ROUGE-L recall and item recall",
        generate_long_copy,
        "copy_rouge_l",
        LONG_COPY_MAX_NEW_TOKENS,  # nominal: each sample uses ceil(1.3 x its reference's tokens)
        "long_copy",
        options=("depth",),
    )
    return tasks


TASKS: dict[str, TaskSpec] = _build_registry()
"""Registered tasks by name."""

RULER_TASKS: tuple[str, ...] = (
    *NIAH_CONFIGS,
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
"""RULER's 13 tasks in their usual order."""


def list_tasks() -> list[str]:
    """Names of all registered tasks."""
    return list(TASKS)


def generate_task(
    name: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    **options: Any,
) -> list[Sample]:
    """Generate ``num_samples`` samples of task ``name`` whose prompt plus generation fits ``length`` tokens.

    ``haystack`` selects the prose for tasks that use one (RULER's essay tasks, ``needle``; default
    ``"jargon"``); tasks with a fixed haystack ignore it and record theirs in ``meta["haystack"]``.
    ``options`` are task specific: ``squad_path`` (qa_1), ``hotpotqa_path`` (qa_2), ``depth`` (passkey,
    long_copy; percent), ``depths`` (needle). The same arguments always give the same samples.
    """
    if name not in TASKS:
        raise InvalidParameterError(f"name={name!r}: unknown task; choose one of {list_tasks()}.")
    spec = TASKS[name]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        allowed = ", ".join(spec.options) or "none"
        raise InvalidParameterError(f"task {name!r} does not take option(s) {unknown}; allowed: {allowed}.")
    accepted = inspect.signature(spec.generate).parameters
    kwargs = {key: value for key, value in options.items() if key in accepted}
    return spec.generate(name, tokenizer, length, num_samples, seed=seed, haystack=haystack, **kwargs)
