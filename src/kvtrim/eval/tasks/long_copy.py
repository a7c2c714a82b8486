"""Long-output copying: write out a numbered list of word-code items hidden in a noise haystack.

Most long-context tasks have short answers, so they only exercise the KV cache built at prefill. Here the
answer is a list of ``LONG_COPY_ITEMS`` items, about 150-300 tokens, which the model has to keep reading from
the context while its own output grows; methods that also compress the cache *during decoding* (LagKV
compresses every ``L`` generated tokens, Liang et al., 2025, arXiv 2504.04704) can then evict parts of the
list or of the answer written so far. The 64-digit passkey of :mod:`~kvtrim.eval.tasks.passkey` (LagKV's
long-output setting) has the same motivation with a 64-token answer; this task makes the answer longer and
scores it partially.

Prompt (lines joined with ``\\n``)::

    <intro: a numbered list of items is hidden in the filler text; memorize it>
    <noise prefix>
    Here is the list of items to remember:
    1. village: 5104
    ...                                            (LONG_COPY_ITEMS lines "i. word: code")
    20. potato: 1230
    End of the list.
    <noise suffix>
    <question: write out the whole list in its original order>     (``question``)
    Here is the list of items to remember:                         (``answer_prefix``)

The filler is the passkey garbage (RULER's noise block repeated, cut to ``n`` characters) and ``n`` is
fitted so that the prompt plus ``max_new_tokens`` lands just under the target length, within
:func:`~kvtrim.eval.tasks.base.length_tolerance`. The list starts after ``int(n * depth / 100)`` filler
characters for a given ``depth`` (percent), otherwise at a seeded uniform depth (as the passkey task). Words
are drawn without replacement from :data:`LONG_COPY_WORDS` (common concrete nouns) and codes are distinct
integers in ``[1000, 9999]``. The answer prefix repeats the list's heading so that the model starts copying
at once (a 135M-parameter instruct model otherwise tends to copy the filler); the chat template is applied.

``answers`` holds the items without their list numbers (``"village: 5104"``, in order);
``meta["reference"]`` is the list exactly as written in the context. ``max_new_tokens`` is set per sample
to ``ceil(1.3 * tokens(reference))`` with the given tokenizer (about 275 for SmolLM2, whose tokenizer splits
digits); the registry's nominal value, :data:`LONG_COPY_MAX_NEW_TOKENS`, is only indicative. The model is
not told to stop, and small models rarely do, so the answer budget is kept small (30% over the reference)
and the primary metric is recall-oriented:

* ``copy_rouge_l`` (primary): ROUGE-L recall of the prediction against the items joined in order (words
  and codes; list numbers are not part of the reference and extra output is not penalised).
* ``copy_item_recall`` (``meta["secondary_metrics"]``): the fraction of items reproduced exactly (word
  followed by its code), in any order.
"""

from __future__ import annotations

import math
import random
from typing import Any

from kvtrim.eval.tasks.base import Sample, TokenCounter, check_common_args
from kvtrim.eval.tasks.filler import Hidden, filler_samples

__all__ = [
    "LONG_COPY_ANSWER_PREFIX",
    "LONG_COPY_BUDGET_FACTOR",
    "LONG_COPY_HEADING",
    "LONG_COPY_INTRO",
    "LONG_COPY_ITEMS",
    "LONG_COPY_MAX_NEW_TOKENS",
    "LONG_COPY_QUESTION",
    "LONG_COPY_WORDS",
    "generate_long_copy",
]

LONG_COPY_ITEMS = 20
"""Number of items in the list."""

LONG_COPY_BUDGET_FACTOR = 1.3
"""``max_new_tokens = ceil(LONG_COPY_BUDGET_FACTOR * tokens(reference))``."""

LONG_COPY_MAX_NEW_TOKENS = 280
"""Nominal generation length for the registry (SmolLM2: references of about 210 tokens x 1.3)."""

LONG_COPY_INTRO = (
    "Somewhere in the filler text below there is a numbered list of items, each a word followed by a "
    "4-digit code. Memorize the whole list: you will be asked to write it out."
)
LONG_COPY_HEADING = "Here is the list of items to remember:"
LONG_COPY_END = "End of the list."
LONG_COPY_QUESTION = (
    "Write out the whole list of items from the text above in its original order, one item per line, "
    "each with its number, its word and its code."
)
LONG_COPY_ANSWER_PREFIX = LONG_COPY_HEADING

LONG_COPY_WORDS: tuple[str, ...] = (
    "anchor", "apple", "basket", "bottle", "bridge", "bucket", "button", "cactus", "camera", "candle",
    "carpet", "castle", "cherry", "cloud", "coffee", "cookie", "copper", "crayon", "desert", "diamond",
    "dolphin", "dragon", "drum", "eagle", "engine", "falcon", "feather", "forest", "garden", "garlic",
    "glove", "guitar", "hammer", "helmet", "honey", "island", "jacket", "jungle", "kettle", "kitten",
    "ladder", "lantern", "lemon", "lobster", "magnet", "mango", "marble", "meadow", "mirror", "napkin",
    "needle", "ocean", "onion", "orange", "parrot", "peanut", "pencil", "pepper", "pillow", "pirate",
    "planet", "pocket", "potato", "pumpkin", "puzzle", "rabbit", "ribbon", "river", "robot", "rocket",
    "saddle", "salmon", "sandal", "shovel", "spider", "spoon", "statue", "sugar", "tiger", "tomato",
    "tractor", "tunnel", "turtle", "umbrella", "valley", "village", "violin", "wagon", "wallet", "walnut",
    "whistle", "window", "wizard", "yogurt", "zebra", "banana", "blanket", "kite", "nest", "quilt",
)  # fmt: skip
"""Common concrete nouns the items are drawn from (none occurs in the noise filler)."""


def _items(rng: Any) -> list[str]:
    words = rng.sample(LONG_COPY_WORDS, LONG_COPY_ITEMS)
    codes = rng.sample(range(1000, 10000), LONG_COPY_ITEMS)
    return [f"{word}: {code}" for word, code in zip(words, codes, strict=True)]


def _reference(items: list[str]) -> str:
    return "\n".join(f"{i}. {item}" for i, item in enumerate(items, start=1))


def generate_long_copy(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    depth: float | None = None,
) -> list[Sample]:
    """Generate ``long_copy`` samples; ``depth`` (0-100) fixes where the list sits (default: seeded random).

    ``haystack`` is ignored: the filler is always the noise block (``meta["haystack"] = "noise"``).
    """
    check_common_args(task, length, num_samples, seed)

    def draw(rng: random.Random, counter: TokenCounter) -> Hidden:
        items = _items(rng)
        fraction = rng.random()  # drawn once so the list does not move while fitting n
        reference = _reference(items)
        reference_tokens = counter.count(reference)
        meta = {
            "num_items": len(items),
            "reference": reference,
            "reference_tokens": reference_tokens,
            "chat_template": True,
            "secondary_metrics": ["copy_item_recall"],
        }
        block = "\n".join([LONG_COPY_HEADING, reference, LONG_COPY_END])
        return Hidden(block, items, fraction, math.ceil(LONG_COPY_BUDGET_FACTOR * reference_tokens), meta)

    return filler_samples(task, tokenizer, length, num_samples, seed, depth, draw, intro=LONG_COPY_INTRO,
                          question=LONG_COPY_QUESTION, answer_prefix=LONG_COPY_ANSWER_PREFIX, metric="copy_rouge_l",
                          head_meta={"benchmark": "long_copy"}, offset_name="list")  # fmt: skip
