"""Passkey retrieval in the Landmark-Attention / LongLoRA format, plus a 64-digit variant.

Prompt (lines joined with ``\\n``)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will
      quiz you about the important information there.          (one line; wrapped here)
    <garbage prefix>
    The pass key is {K}. Remember it. {K} is the pass key.
    <garbage suffix>
    What is the pass key? The pass key is

The garbage is RULER's noise block repeated and joined by spaces, measured in characters: the prefix is
its first ``n_pre`` characters and the suffix its first ``n - n_pre`` characters. ``n`` is fitted so the
prompt plus ``max_new_tokens`` lands just under the target length. ``n_pre = int(n * depth / 100)`` for a
given ``depth`` (percent), otherwise uniform in ``[0, n]`` as in LongLoRA. The question line is
``question``; ``context`` is everything before it, and there is no answer prefix (base-model completion
format, ``meta["chat_template"] = False``).

* ``passkey``: ``K = randint(1, 50000)``, 10 new tokens, metric ``passkey_match`` (the first integer in
  the response equals K).
* ``passkey_64``: a 64-digit K (first digit non-zero), the long-passkey setting of the LagKV paper;
  72 new tokens (tokenizers that split digits need 64 tokens for K); metrics ``passkey_match``
  (exact) and ``passkey_digit_accuracy`` (fraction of the 64 digits correct by position).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.tasks.base import Sample, TokenCounter
from kvtrim.eval.tasks.filler import Hidden, filler_samples

__all__ = ["PASSKEY_ANSWER_PREFIX", "PASSKEY_INFO", "PASSKEY_INTRO", "PASSKEY_QUESTION", "generate_passkey"]

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_INFO = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
# The format's last line is "What is the pass key? The pass key is"; the completion cue is the answer prefix so
# that chat models get it at the start of their own turn (context + question + answer_prefix is the original).
PASSKEY_ANSWER_PREFIX = " The pass key is"


@dataclass(frozen=True)
class _Variant:
    digits: int | None  # None: randint(1, 50000)
    max_new_tokens: int
    secondary_metrics: tuple[str, ...] = ()


_VARIANTS = {
    "passkey": _Variant(digits=None, max_new_tokens=10),
    "passkey_64": _Variant(digits=64, max_new_tokens=72, secondary_metrics=("passkey_digit_accuracy",)),
}


def generate_passkey(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    depth: float | None = None,
) -> list[Sample]:
    """Generate ``passkey`` or ``passkey_64`` samples; ``depth`` (0-100) fixes where the key sits."""
    if task not in _VARIANTS:
        raise InvalidParameterError(f"task={task!r}: expected one of {sorted(_VARIANTS)}.")
    if not isinstance(length, int) or length <= 0:
        raise InvalidParameterError(f"length={length!r}: expected a positive number of tokens.")
    if not isinstance(num_samples, int) or num_samples < 0:
        raise InvalidParameterError(f"num_samples={num_samples!r}: expected an integer >= 0.")
    variant = _VARIANTS[task]
    digits = variant.digits

    def draw(rng: random.Random, counter: TokenCounter) -> Hidden:
        if digits is None:
            key = str(rng.randint(1, 50000))
        else:
            key = str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))
        fraction = rng.random()  # drawn once so the key position does not move while fitting n
        meta = {"chat_template": False, "secondary_metrics": list(variant.secondary_metrics)}
        return Hidden(PASSKEY_INFO.format(key=key), [key], fraction, variant.max_new_tokens, meta)

    return filler_samples(task, tokenizer, length, num_samples, seed, depth, draw, intro=PASSKEY_INTRO,
                          question=PASSKEY_QUESTION, answer_prefix=PASSKEY_ANSWER_PREFIX, metric="passkey_match",
                          head_meta={"benchmark": "passkey", "format": "landmark"}, offset_name="key")  # fmt: skip
