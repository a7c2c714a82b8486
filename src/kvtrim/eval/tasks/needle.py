"""Needle-in-a-Haystack, KV-compression-paper variant (KVCache-Factory / HeadKV, after Yao Fu's repo).

For each context length ``L`` and depth ``p``:

1. The haystack text is concatenated with itself until it has at least ``max(lengths)`` tokens, then
   cut to ``L`` tokens (Kamradt's ``encode_and_trim``).
2. ``L`` is reduced by ``buffer`` (Kamradt's ``final_context_length_buffer = 200``, room for the prompt
   wrapper and the answer) and the context is cut to ``L - buffer - len(needle)`` tokens.
3. The needle is inserted at token ``int(len(context) * p / 100)``, walked back to just after the
   previous sentence-ending token; for ``p = 100`` it is appended. A "sentence-ending token" is any
   token whose text, stripped of trailing whitespace, ends with ``.`` (Kamradt hard-codes each model's
   period token ids; this rule covers them and tokenizers that merge ``.`` with a newline).
4. The token list is decoded and wrapped in the completion-style prompt
   ``<|im_start|> This is a very long story book: <book> {context} </book>.\\n Based on the content of
   the book, Question: {question}\\nAnswer:`` (``<|im_start|>`` is literal text, as in the reference).

Generation: greedy, 30 new tokens, stop on EOS or newline (``meta["stop_on_newline"]``), no chat
template. Score: ``needle_recall`` (recall of the word set of the expected answer among the response's
words, lower-cased whitespace split), plus ``needle_rouge1`` (ROUGE-1 F against the needle; the
reference stores it x10). The Paul Graham essays are replaced by the ``haystack`` text (``"jargon"`` by
default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import get_haystack
from kvtrim.eval.tasks.base import Sample, TokenCounter

__all__ = [
    "NEEDLE",
    "NEEDLE_ANSWER",
    "NEEDLE_BUFFER",
    "NEEDLE_DEFAULT_DEPTHS",
    "NEEDLE_MAX_NEW_TOKENS",
    "NEEDLE_QUESTION",
    "generate_needle",
    "needle_grid",
]

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
NEEDLE_QUESTION = "The best thing to do in San Francisco is: "
NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_BUFFER = 200
NEEDLE_MAX_NEW_TOKENS = 30
NEEDLE_DEFAULT_DEPTHS = [round(100 * i / 9) for i in range(10)]  # round(linspace(0, 100, 10))

_PROMPT_HEAD = "<|im_start|> This is a very long story book: <book> "
_PROMPT_TAIL = " </book>.\n"
_QUESTION = " Based on the content of the book, Question: {question}\nAnswer:"


def _haystack_tokens(counter: TokenCounter, text: str, needed: int) -> list[int]:
    """Token ids of the haystack, concatenated with itself until it has more than ``needed`` tokens.

    Only a prefix of a long haystack is tokenized; the last (possibly cut) token is never used because
    more than ``needed`` tokens are returned.
    """
    chars = max(4096, needed * 8)
    while True:
        source = text * (chars // len(text) + 1) if chars > len(text) else text
        ids = counter.encode(source[:chars])
        if len(ids) > needed:
            return ids
        chars *= 2


def needle_grid(
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    haystack: str = "jargon",
    *,
    needle: str = NEEDLE,
    question: str = NEEDLE_QUESTION,
    expected_answer: str = NEEDLE_ANSWER,
    buffer: int = NEEDLE_BUFFER,
    seed: int = 0,
) -> list[Sample]:
    """Samples for every (length, depth) pair, lengths outer and depths inner.

    ``lengths`` are context lengths in tokens (e.g. ``range(1000, 8001, 100)``); ``depths`` are
    percentages (default ``round(linspace(0, 100, 10))``). ``seed`` is recorded but unused: the grid
    is deterministic.
    """
    lengths = [int(length) for length in lengths]
    depths = list(NEEDLE_DEFAULT_DEPTHS if depths is None else depths)
    if not lengths:
        raise InvalidParameterError("lengths=[]: give at least one context length.")
    if any(not 0 <= d <= 100 for d in depths):
        raise InvalidParameterError(f"depths={depths!r}: every depth must be a percentage in [0, 100].")
    if buffer < 0:
        raise InvalidParameterError(f"buffer={buffer!r}: expected >= 0 tokens.")
    counter = TokenCounter(tokenizer)
    needle_ids = counter.encode(needle)
    for length in lengths:
        if length - buffer - len(needle_ids) <= 0:
            raise InvalidParameterError(
                f"lengths: {length} tokens leave no room for a haystack after the {buffer}-token buffer and "
                f"the {len(needle_ids)}-token needle."
            )
    haystack_ids = _haystack_tokens(counter, get_haystack(haystack), max(lengths))
    period_cache: dict[int, bool] = {}

    def is_period(token_id: int) -> bool:
        if token_id not in period_cache:
            period_cache[token_id] = counter.decode([token_id]).rstrip().endswith(".")
        return period_cache[token_id]

    question_text = _QUESTION.format(question=question)
    samples: list[Sample] = []
    for length in lengths:
        limit = length - buffer
        base = haystack_ids[:length]
        if len(base) + len(needle_ids) > limit:
            base = base[: limit - len(needle_ids)]
        for depth in depths:
            if depth == 100:
                insertion = len(base)
            else:
                insertion = int(len(base) * depth / 100)
                while insertion > 0 and not is_period(base[insertion - 1]):
                    insertion -= 1
            ids = base[:insertion] + needle_ids + base[insertion:]
            text = counter.decode(ids)
            context = _PROMPT_HEAD + text + _PROMPT_TAIL
            needle_offset = context.find(needle.strip())
            prompt_tokens = counter.count(context + question_text)
            samples.append(
                Sample(
                    task="needle",
                    context=context,
                    question=question_text,
                    answer_prefix="",
                    answers=[expected_answer],
                    metric="needle_recall",
                    max_new_tokens=NEEDLE_MAX_NEW_TOKENS,
                    index=len(samples),
                    seed=seed,
                    meta={
                        "benchmark": "needle",
                        "variant": "kv-compression (KVCache-Factory / HeadKV)",
                        "target_length": length,
                        "context_length": length,
                        "depth_percent": depth,
                        "buffer": buffer,
                        "haystack": haystack,
                        "needle": needle,
                        "insertion_token_index": insertion,
                        "haystack_tokens": len(base),
                        "needle_char_offset": needle_offset,
                        "prompt_tokens": prompt_tokens,
                        "length": prompt_tokens + NEEDLE_MAX_NEW_TOKENS,
                        "chat_template": False,
                        "stop_on_newline": True,
                        "secondary_metrics": ["needle_rouge1"],
                    },
                )
            )
    return samples


def generate_needle(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    depths: Sequence[float] | None = None,
) -> list[Sample]:
    """``generate_task("needle", ...)``: one length, ``num_samples`` depths evenly spaced over 0-100 %
    (``round(linspace(0, 100, num_samples))``) unless ``depths`` is given."""
    if depths is None:
        if num_samples <= 0:
            return []
        depths = [0] if num_samples == 1 else [round(100 * i / (num_samples - 1)) for i in range(num_samples)]
    elif len(depths) != num_samples:
        raise InvalidParameterError(f"depths has {len(depths)} entries but num_samples={num_samples}.")
    return needle_grid(tokenizer, [length], depths, haystack or "jargon", seed=seed)
