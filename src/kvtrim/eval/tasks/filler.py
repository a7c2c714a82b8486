"""The noise filler of the passkey-style tasks: one text inserted at a depth of RULER's noise block, fitted to a
target length in characters of filler.

Prompt context (lines joined with ``\\n``, ending with one)::

    <intro>
    <garbage prefix: the first n_pre characters of the noise block repeated and joined by spaces>
    <the inserted text>
    <garbage suffix: the first n - n_pre characters of the same>

``n`` is the largest filler size whose context plus ``tail`` (the question and answer prefix) fits the target
length less the tokens to generate; ``n_pre = int(n * depth / 100)`` for a given ``depth`` (percent), otherwise
``min(n, int(fraction * (n + 1)))`` for a fraction the sample drew once (uniform in ``[0, n]``, as in LongLoRA).
:func:`filler_samples` makes a task's samples from what each one hides (:class:`Hidden`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import NOISE_BLOCK
from kvtrim.eval.tasks.base import Sample, TokenCounter, fit_units, sample_rng

__all__ = ["FilledContext", "Hidden", "check_depth", "fill_to_length", "filler_samples", "garbage"]


def garbage(chars: int) -> str:
    """The first ``chars`` characters of the noise block repeated and joined by spaces."""
    repeats = chars // (len(NOISE_BLOCK) + 1) + 2
    return " ".join([NOISE_BLOCK] * repeats)[:chars]


def check_depth(depth: float | None) -> None:
    """``depth`` is a percentage in ``[0, 100]`` or None (a random depth per sample)."""
    if depth is not None and not 0 <= depth <= 100:
        raise InvalidParameterError(f"depth={depth!r}: expected a percentage in [0, 100] or None (random).")


@dataclass(frozen=True)
class FilledContext:
    """A fitted context: the text, its filler size, the length and placement meta, where the insert starts."""

    context: str
    garbage_chars: int
    meta: dict[str, Any]  # target_length, length, prompt_tokens, haystack, garbage_* , depth_percent, requested_depth
    insert_char_offset: int
    insert_token_offset: int | None  # None where the tokenizer gives no offsets


def fill_to_length(
    counter: TokenCounter,
    *,
    intro: str,
    insert: str,
    tail: str,
    length: int,
    max_new_tokens: int,
    depth: float | None,
    fraction: float,
    hint: int | None,
    what: str,
) -> FilledContext:
    """The context of one sample: ``insert`` inside the largest filler with which ``context + tail`` plus
    ``max_new_tokens`` fits ``length`` tokens (module docstring); ``hint``: a filler size to start the search at."""

    def build(n: int) -> tuple[str, int]:
        n_pre = int(n * depth / 100) if depth is not None else min(n, int(fraction * (n + 1)))
        lines = [intro, garbage(n_pre), insert, garbage(n - n_pre)]
        return "\n".join(lines) + "\n", n_pre

    result = fit_units(
        build,
        lambda built: counter.count(built[0] + tail),
        length - max_new_tokens,
        0,
        max(64 * length, 64),
        hint,
        what=what,
    )
    context, n_pre = result.value
    offset = context.find(insert)
    token_offsets = counter.char_to_token(context, [offset])
    meta: dict[str, Any] = {
        "target_length": length,
        "length": result.tokens + max_new_tokens,
        "prompt_tokens": result.tokens,
        "haystack": "noise",
        "garbage_chars": result.units,
        "garbage_prefix_chars": n_pre,
        "depth_percent": round(100 * n_pre / result.units, 2) if result.units else 0.0,
        "requested_depth": depth,
    }
    return FilledContext(context, result.units, meta, offset, None if token_offsets is None else token_offsets[0])


@dataclass(frozen=True)
class Hidden:
    """What one sample hides in the filler and is scored on, drawn from the sample's RNG."""

    insert: str
    answers: list[str]
    fraction: float  # where the insert sits without a depth (drawn once, so it does not move while fitting)
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)  # the task's own meta, after the length and placement meta


def filler_samples(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int,
    depth: float | None,
    draw: Callable[[random.Random, TokenCounter], Hidden],
    *,
    intro: str,
    question: str,
    answer_prefix: str,
    metric: str,
    head_meta: dict[str, Any],
    offset_name: str,
) -> list[Sample]:
    """``num_samples`` samples of ``task``: ``draw(rng, counter)`` the sample's :class:`Hidden` text, inserted at
    ``depth`` (None: random) in the filler fitted to ``length`` (:func:`fill_to_length`); ``question`` and
    ``answer_prefix`` follow the context. ``meta``: ``head_meta``, the length and placement meta, the insert's
    character offset (``{offset_name}_char_offset``), the task's own, then its token offset where the tokenizer
    gives offsets (``{offset_name}_token_offset``)."""
    check_depth(depth)
    counter = TokenCounter(tokenizer)
    samples: list[Sample] = []
    hint: int | None = None
    for index in range(num_samples):
        hidden = draw(sample_rng(task, seed, index), counter)
        filled = fill_to_length(
            counter,
            intro=intro,
            insert=hidden.insert,
            tail=question + answer_prefix,
            length=length,
            max_new_tokens=hidden.max_new_tokens,
            depth=depth,
            fraction=hidden.fraction,
            hint=hint,
            what=f"{task} prompt",
        )
        hint = filled.garbage_chars
        meta = {**head_meta, **filled.meta, f"{offset_name}_char_offset": filled.insert_char_offset, **hidden.meta}
        if filled.insert_token_offset is not None:
            meta[f"{offset_name}_token_offset"] = filled.insert_token_offset
        samples.append(
            Sample(
                task=task,
                context=filled.context,
                question=question,
                answer_prefix=answer_prefix,
                answers=hidden.answers,
                metric=metric,
                max_new_tokens=hidden.max_new_tokens,
                index=index,
                seed=seed,
                meta=meta,
            )
        )
    return samples
