"""Shared machinery of the needle-in-a-haystack calibrations (HeadKV, CompressKV).

* **Prompts.** A haystack of natural prose (:func:`kvtrim.eval.haystacks.get_haystack`) is tokenized once
  (:func:`haystack_ids`); each test cuts it to the target length, inserts the needle at a depth moved back to the
  preceding sentence end (:func:`insert_needle`, Kamradt / Retrieval_Head), and wraps context, question and
  answer prefix in the model's prompt template (:func:`needle_prompt`).
* **Decoding.** :func:`greedy_decode_with_attention` prefills the prompt minus its last token, then decodes
  greedily with eager attention so that every step returns the attention row of the query that *produced* the
  new token, per layer and query head; a callback receives ``(token, attention [layers, q_heads, keys])``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrim.errors import InvalidParameterError

__all__ = [
    "NEEDLE_MARK",
    "NeedleRun",
    "attention_implementation",
    "char_span_tokens",
    "depth_grid",
    "eos_ids",
    "greedy_decode_with_attention",
    "haystack_ids",
    "insert_needle",
    "needle_prompt",
    "prepare_needle_run",
]

NEEDLE_MARK = "\x00NEEDLE\x00"


def depth_grid(depths: int | Sequence[float]) -> list[float]:
    """``n`` depths ``round(linspace(0, 100, n))`` for an int, else the given percentages."""
    if isinstance(depths, int):
        if depths <= 0:
            raise InvalidParameterError(f"depths={depths}: give a positive number of depths")
        return [0.0] if depths == 1 else [float(round(100 * i / (depths - 1))) for i in range(depths)]
    out = [float(d) for d in depths]
    if not out or any(not 0 <= d <= 100 for d in out):
        raise InvalidParameterError(f"depths={depths!r}: give percentages in [0, 100]")
    return out


def haystack_ids(tokenizer: Any, text: str, needed: int, start: int) -> list[int]:
    """Token ids of ``text`` from character ``start`` on, repeated as needed, longer than ``needed``."""
    text = text[start:] + "\n\n" + text[:start] if start else text
    chars = max(4096, needed * 8)
    while True:
        source = text * (chars // len(text) + 1) if chars > len(text) else text
        ids = tokenizer(source[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > needed + 1:
            return list(ids)
        chars *= 2


def insert_needle(tokenizer: Any, hay: list[int], needle_len: int, length: int, depth: float, periods: dict) -> str:
    """Haystack text of ``length - needle_len`` tokens with a :data:`NEEDLE_MARK` at ``depth`` percent, moved back
    to just after a sentence end (Kamradt / HeadKV). ``periods`` caches which token ids end a sentence."""
    base = hay[: max(0, length - needle_len)]
    if depth >= 100:
        cut = len(base)
    else:
        cut = int(len(base) * depth / 100)

        def is_period(tok: int) -> bool:
            if tok not in periods:
                periods[tok] = tokenizer.decode([tok]).rstrip().endswith(".")
            return periods[tok]

        while cut > 0 and not is_period(base[cut - 1]):
            cut -= 1
    return tokenizer.decode(base[:cut]) + NEEDLE_MARK + tokenizer.decode(base[cut:])


def needle_prompt(
    tokenizer: Any,
    template: Any,
    hay: list[int],
    needle: str,
    question: str,
    answer_prefix: str,
    length: int,
    depth: float,
    periods: dict,
) -> tuple[str, list[int], int]:
    """One test prompt: ``(prompt text, token ids, character offset of the needle in the prompt)``.

    ``template`` is a :class:`~kvtrim.prompts.PromptTemplate`; the context holds ``length`` tokens (haystack plus
    needle), the question follows in the same user turn and ``answer_prefix`` opens the assistant turn.
    """
    needle_len = len(tokenizer(needle, add_special_tokens=False)["input_ids"])
    context = insert_needle(tokenizer, hay, needle_len, length, depth, periods).replace(NEEDLE_MARK, needle)
    prompt = template.context_part(context) + template.question_part(question) + answer_prefix
    special = template.prefix == ""  # a chat template already carries its special tokens
    ids = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
    return prompt, ids, prompt.index(needle, len(template.prefix))


def char_span_tokens(tokenizer: Any, prompt: str, ids: list[int], char_start: int, char_end: int, span: str) -> tuple:
    """Token range ``[start, end)`` covering characters ``[char_start, char_end)`` of ``prompt``."""
    try:
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        shift = len(ids) - len(enc["input_ids"])  # special tokens added in front
        inside = [i for i, (a, b) in enumerate(offsets) if b > char_start and a < char_end and b > a]
        if inside:
            return inside[0] + shift, inside[-1] + 1 + shift
    except (NotImplementedError, TypeError, ValueError, KeyError):
        pass
    # Slow tokenizers: the window of |span| tokens with the largest token overlap (reference method).
    span_ids = tokenizer(span, add_special_tokens=False)["input_ids"]
    want, best, start = set(span_ids), -1.0, 0
    for i in range(len(ids) - len(span_ids) + 1):
        overlap = len(want & set(ids[i : i + len(span_ids)])) / max(1, len(want))
        if overlap >= best:
            best, start = overlap, i
    return start, start + len(span_ids)


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Switch ``model`` to attention implementation ``name`` and restore the previous one on exit."""
    previous = model.config._attn_implementation
    if previous == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """End-of-sequence token ids of the model's generation config and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


@torch.no_grad()
def greedy_decode_with_attention(
    model: torch.nn.Module,
    tokenizer: Any,
    ids: list[int],
    steps: int,
    eos: set[int],
    newline: dict[int, bool],
    on_step: Callable[[int, torch.Tensor], None],
) -> list[int]:
    """Greedy decoding that hands every step's attention to ``on_step``; returns the generated ids (no EOS).

    The prompt minus its last token is prefilled; each of at most ``steps`` decoding steps feeds the previous
    token with eager attention and calls ``on_step(token, attention)`` with the new token and the attention of the
    query that produced it, ``[layers, q_heads, keys]`` float32 (``keys`` = prompt plus tokens fed so far).
    Decoding stops after an EOS token, or after a newline once the response holds non-blank text. ``newline``
    caches which token ids contain a newline.
    """
    device = model.get_input_embeddings().weight.device
    prompt = torch.tensor([ids], device=device)
    out = model(input_ids=prompt[:, :-1], use_cache=True)
    cache = out.past_key_values
    generated: list[int] = []
    inp = prompt[:, -1:]
    with attention_implementation(model, "eager"):
        for _ in range(steps):
            out = model(input_ids=inp, past_key_values=cache, use_cache=True, output_attentions=True)
            cache = out.past_key_values
            att = torch.stack([a[0, :, -1, :] for a in out.attentions]).float().cpu()  # [L, H, kv], scored on CPU
            token = int(out.logits[0, -1].argmax())
            on_step(token, att)
            if token in eos:
                break
            generated.append(token)
            if token not in newline:
                newline[token] = "\n" in tokenizer.decode([token])
            if newline[token] and tokenizer.decode(generated).strip():
                break
            inp = torch.tensor([[token]], device=device)
    return generated


@dataclass
class NeedleRun:
    """What every test of a needle calibration shares: the ``(length, depth, needle)`` grid, the tokenized
    haystack, the prompt template, end-of-sequence ids and the model's geometry."""

    lengths: list[int]
    depths: list[float]
    haystack_start: int  # character offset in the haystack text where contexts start
    grid: list[tuple[int, float, Any]]
    hay: list[int]
    template: Any
    eos: set[int]
    layers: int
    heads: int
    started: float
    periods: dict = field(default_factory=dict)  # token id -> ends a sentence (cache for insert_needle)
    newline: dict = field(default_factory=dict)  # token id -> contains a newline (cache for decoding)


def prepare_needle_run(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int],
    depths: int | Sequence[float],
    needles: Sequence[Any],
    haystack: str,
    seed: int,
    use_chat_template: bool,
) -> NeedleRun:
    """Validate the grid and load what the tests share; ``seed`` picks where in the haystack contexts start."""
    from kvtrim.eval.haystacks import get_haystack
    from kvtrim.prompts import prompt_template

    lengths = [int(x) for x in lengths]
    depth_list = depth_grid(depths)
    if not lengths or any(x <= 0 for x in lengths):
        raise InvalidParameterError(f"lengths={lengths!r}: give positive context lengths in tokens")
    if not needles:
        raise InvalidParameterError("needles=[]: give at least one needle")
    started = time.perf_counter()
    text = get_haystack(haystack)
    offset = 0
    if seed:
        offset = random.Random(seed).randrange(len(text))
        offset = text.find("\n", offset) + 1 or 0
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return NeedleRun(
        lengths=lengths,
        depths=depth_list,
        haystack_start=offset,
        grid=[(length, depth, spec) for spec in needles for length in lengths for depth in depth_list],
        hay=haystack_ids(tokenizer, text, max(lengths), offset),
        template=prompt_template(tokenizer, use_chat_template),
        eos=eos_ids(model, tokenizer),
        layers=int(config.num_hidden_layers),
        heads=int(config.num_attention_heads),
        started=started,
    )
