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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import NOISE_BLOCK
from kvtrim.eval.tasks.base import TokenCounter, fit_units

__all__ = ["FilledContext", "check_depth", "fill_to_length", "garbage"]


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
