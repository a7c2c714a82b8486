"""Shared pieces of the task generators: the :class:`Sample` format, token counting and length fitting."""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from kvtrim.errors import InvalidParameterError

__all__ = [
    "LENGTH_TOLERANCE_FRACTION",
    "LENGTH_TOLERANCE_TOKENS",
    "BuiltPrompt",
    "FitResult",
    "Sample",
    "TaskSpec",
    "TokenCounter",
    "check_common_args",
    "fit_units",
    "fitted_samples",
    "length_tolerance",
    "sample_rng",
    "split_at_last",
]

LENGTH_TOLERANCE_TOKENS = 30
LENGTH_TOLERANCE_FRACTION = 0.02


def length_tolerance(length: int) -> int:
    """How far below ``length`` a fitted sample may land: ``max(30, 2% of length)`` tokens.

    Generators whose haystack grows in fine steps (words, lines, characters) always land within this
    tolerance. Tasks whose haystack unit is a whole document or needle (``qa_*``, ``niah_multikey_2/3``)
    can land up to one unit lower when a unit is longer than the tolerance, as in RULER.
    """
    return max(LENGTH_TOLERANCE_TOKENS, int(LENGTH_TOLERANCE_FRACTION * length))


@dataclass(frozen=True)
class Sample:
    """One evaluation prompt, split for context-only (query-agnostic) compression.

    ``context`` is the long part that gets compressed; ``question`` is asked after it (appended after
    compression in context-only mode); ``answer_prefix`` opens the assistant turn (RULER) and may be
    empty. ``context + question + answer_prefix`` is the benchmark's original prompt (before any chat
    template). ``metric`` names a function in :data:`kvtrim.eval.metrics.METRICS`. ``meta`` holds
    provenance: target and measured lengths, haystack, needle positions, whether the benchmark applies
    the chat template, and so on.
    """

    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    index: int
    seed: int
    meta: dict[str, Any] = field(default_factory=dict)

    def full_prompt(self) -> str:
        """Context followed by the question (what question-aware mode prefills)."""
        return self.context + self.question

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (inverse of :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Rebuild a sample written by :meth:`to_dict`."""
        return cls(**data)


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: how to generate it and how it is scored."""

    name: str
    description: str
    generate: Callable[..., list[Sample]]
    metric: str
    max_new_tokens: int
    family: str
    options: tuple[str, ...] = ()
    uses_haystack: bool = False


def sample_rng(task: str, seed: int, index: int, *extra: object) -> random.Random:
    """A private RNG for one sample, determined only by (task, seed, index, extra)."""
    key = "/".join(str(part) for part in (task, seed, index, *extra))
    return random.Random(key)


def split_at_last(text: str, pattern: re.Pattern[str]) -> tuple[str, str]:
    """Split ``text`` at the start of the last match of ``pattern`` (kvpress's context/question split)."""
    matches = list(pattern.finditer(text))
    if not matches:
        raise ValueError(f"pattern {pattern.pattern!r} not found in prompt")
    cut = matches[-1].start()
    return text[:cut], text[cut:]


class TokenCounter:
    """Counts tokens of plain text (no special tokens, no chat template) with any HF tokenizer.

    Uses the fast backend (``tokenizer.backend_tokenizer``) when available, which avoids the
    "sequence longer than model_max_length" warnings; otherwise falls back to ``tokenizer.encode``.
    """

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise InvalidParameterError("tokenizer=None: a Hugging Face tokenizer is required to fit lengths.")
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):
            backend = tokenizer  # a raw `tokenizers.Tokenizer`
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` without special tokens."""
        if self._backend is not None:
            return len(self._backend.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def token_starts(self, text: str) -> list[int] | None:
        """Character offset where each token starts, or ``None`` if the tokenizer has no offsets."""
        if self._backend is None:
            return None
        return [start for start, _ in self._backend.encode(text, add_special_tokens=False).offsets]

    def char_to_token(self, text: str, char_offsets: Sequence[int]) -> list[int] | None:
        """Index of the token containing each character offset (``None`` without offset support)."""
        starts = self.token_starts(text)
        if starts is None:
            return None
        return [max(0, bisect.bisect_right(starts, offset) - 1) for offset in char_offsets]

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids, skipping special tokens."""
        if self._backend is not None and self._backend is self.tokenizer:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


T = TypeVar("T")


@dataclass(frozen=True)
class FitResult(Generic[T]):
    """The outcome of :func:`fit_units`: unit count, the built object and its token count."""

    units: int
    value: T
    tokens: int


def fit_units(
    build: Callable[[int], T],
    count: Callable[[T], int],
    budget: int,
    low: int,
    high: int,
    hint: int | None = None,
    what: str = "prompt",
) -> FitResult[T]:
    """Largest unit count ``n`` in ``[low, high]`` with ``count(build(n)) <= budget``.

    This replaces RULER's grow-by-increment-then-step-back loop with a bracketing search: it starts at
    ``hint`` (e.g. the previous sample's answer), moves by secant steps using the observed tokens per
    unit, and finishes by bisection, so a sample usually costs two or three tokenizations. Token counts
    need not be strictly monotonic (insertion points move with ``n``); the returned ``n`` is always one
    that was measured to fit. Raises :class:`InvalidParameterError` if even ``low`` units do not fit.
    """
    if high < low:
        raise InvalidParameterError(f"internal: empty unit range [{low}, {high}] for {what}")
    measured: dict[int, tuple[T, int]] = {}

    def measure(n: int) -> int:
        if n not in measured:
            value = build(n)
            measured[n] = (value, count(value))
        return measured[n][1]

    fits: int | None = None  # largest n measured to fit
    over: int | None = None  # smallest n measured not to fit
    n = low if hint is None else min(max(hint, low), high)
    secant_steps = 0
    for _ in range(96):
        tokens = measure(n)
        if tokens <= budget:
            fits = n if fits is None else max(fits, n)
        else:
            over = n if over is None else min(over, n)
        if fits is not None and (fits >= high or (over is not None and over <= fits + 1)):
            break
        if fits is None and over is not None and over <= low:
            break
        lower = low if fits is None else fits + 1
        upper = high if over is None else over - 1
        if fits is not None and over is not None:
            # Bracketed: regula falsi on the bracket ends (token counts are nearly linear in n), falling
            # back to bisection if it stalls.
            t_fit, t_over = measured[fits][1], measured[over][1]
            if secant_steps < 8 and t_over > t_fit:
                secant_steps += 1
                guess = fits + int((budget - t_fit) * (over - fits) / (t_over - t_fit))
            else:
                guess = (lower + upper) // 2
        else:
            # One side known: extrapolate with the slope of the two farthest measurements.
            known = sorted(measured.items())
            (n1, (_, t1)), (n2, (_, t2)) = known[0], known[-1]
            rate = (t2 - t1) / (n2 - n1) if n2 > n1 and t2 > t1 else max(tokens, 1) / max(n, 1)
            guess = n + int((budget - tokens) / rate)
            guess = min(guess, n - 1) if fits is None else max(guess, n + 1)
        guess = min(max(guess, lower), upper)
        if guess in measured:
            guess = (lower + upper) // 2
        n = guess
    if fits is None:
        needed = measure(low)
        raise InvalidParameterError(
            f"length too small: the shortest {what} ({low} haystack units) needs {needed} prompt tokens but "
            f"only {budget} are available after reserving the tokens to generate."
        )
    value, tokens = measured[fits]
    return FitResult(units=fits, value=value, tokens=tokens)


@dataclass
class BuiltPrompt:
    """A generated prompt before length bookkeeping: the split text, answers and sample meta."""

    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    needles: list[str] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        return self.context + self.question + self.answer_prefix


def fitted_samples(
    *,
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int,
    metric: str,
    max_new_tokens: int,
    build: Callable[[int, int], BuiltPrompt],
    low: int,
    high: int,
    unit: str,
    haystack: str,
    extra_meta: dict[str, Any] | None = None,
    chat_template: bool = True,
) -> list[Sample]:
    """Fit each sample's haystack size to ``length`` (``build(index, n)`` makes sample ``index`` with ``n``
    haystack units) and package the results as :class:`Sample` with length and needle-position meta."""
    counter = TokenCounter(tokenizer)
    budget = length - max_new_tokens
    samples: list[Sample] = []
    hint: int | None = None
    for index in range(num_samples):
        result = fit_units(
            lambda n, index=index: build(index, n),
            lambda built: counter.count(built.prompt),
            budget,
            low,
            high,
            hint,
            what=f"{task} prompt",
        )
        hint = result.units
        built = result.value
        meta: dict[str, Any] = {
            "benchmark": "ruler",
            "target_length": length,
            "length": result.tokens + max_new_tokens,
            "prompt_tokens": result.tokens,
            "haystack": haystack,
            "haystack_units": result.units,
            "unit": unit,
            "chat_template": chat_template,
        }
        if extra_meta:
            meta.update(extra_meta)
        meta.update(built.meta)
        if built.needles:
            offsets = [built.context.find(needle) for needle in built.needles]
            meta["needle_char_offsets"] = offsets
            starts = counter.token_starts(built.context)
            if starts is not None:
                token_index = [max(0, bisect.bisect_right(starts, offset) - 1) for offset in offsets]
                context_tokens = len(starts)
                meta["needle_token_offsets"] = token_index
                meta["needle_token_depths"] = [round(100 * t / max(context_tokens, 1), 2) for t in token_index]
                meta["context_tokens"] = context_tokens
        samples.append(
            Sample(
                task=task,
                context=built.context,
                question=built.question,
                answer_prefix=built.answer_prefix,
                answers=list(built.answers),
                metric=metric,
                max_new_tokens=max_new_tokens,
                index=index,
                seed=seed,
                meta=meta,
            )
        )
    return samples


def check_common_args(task: str, length: int, num_samples: int, seed: int) -> None:
    """Validate the arguments every generator shares."""
    if not isinstance(length, int) or length <= 0:
        raise InvalidParameterError(f"length={length!r}: expected a positive number of tokens.")
    if not isinstance(num_samples, int) or num_samples < 0:
        raise InvalidParameterError(f"num_samples={num_samples!r}: expected an integer >= 0.")
    if not isinstance(seed, int):
        raise InvalidParameterError(f"seed={seed!r}: expected an integer.")
