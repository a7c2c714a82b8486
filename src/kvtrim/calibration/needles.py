"""Shared machinery of the needle-in-a-haystack calibrations (HeadKV, CompressKV).

* **Prompts.** A haystack of natural prose (:func:`kvtrim.eval.haystacks.get_haystack`) is tokenized once
  (:func:`haystack_ids`); each test cuts it to the target length, inserts the needle at a depth moved back to the
  preceding sentence end (:func:`insert_needle`, Kamradt / Retrieval_Head), and wraps context, question and
  answer prefix in the model's prompt template (:func:`needle_prompt`).
* **Decoding.** :func:`greedy_decode_with_attention` prefills the prompt minus its last token, then decodes
  greedily (:func:`kvtrim.runtime.greedy_decode`) with eager attention so that every step returns the attention
  row of the query that *produced* the new token, per layer and query head; a callback receives
  ``(token, attention [layers, q_heads, keys])``.
* **Head detection.** :func:`detect_needle_heads` runs every test of a :class:`NeedleRun` and sums per-step head
  scores; what it scores, how many steps it decodes and which tests count come from a :class:`NeedleScorer`
  (HeadKV's retrieval-reasoning scores, CompressKV's SRH/TRH).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.runtime import eos_ids, feed, greedy_decode

__all__ = [
    "NEEDLE_MARK",
    "NeedleHeadScores",
    "NeedleRun",
    "NeedleScorer",
    "NeedleTest",
    "TestPlan",
    "attention_implementation",
    "char_span_tokens",
    "depth_grid",
    "detect_needle_heads",
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
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    prompt = torch.tensor([ids], device=device)
    cache = DynamicCache(config=model.config)
    pre = feed(model, cache, torch.ones_like(prompt[:, :0]), prompt[:, :-1])
    generated: list[int] = []

    def step(_: int, tokens: torch.Tensor, attentions) -> bool:
        token = int(tokens[0])
        att = torch.stack([a[0, :, -1, :] for a in attentions]).float().cpu()  # [L, H, kv], scored on CPU
        on_step(token, att)
        if token in eos:
            return True
        generated.append(token)
        if token not in newline:
            newline[token] = "\n" in tokenizer.decode([token])
        return newline[token] and bool(tokenizer.decode(generated).strip())

    with attention_implementation(model, "eager"):
        last = feed(model, cache, pre.mask, prompt[:, -1:], output_attentions=True)
        greedy_decode(
            model, cache, last.mask, last.logits, steps, eos,
            on_step=step, attentions=last.attentions, output_attentions=True,
        )  # fmt: skip
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


# ---------------------------------------------------------------------------------------------------- detection
@dataclass
class NeedleTest:
    """One test of a needle run: its grid point, prompt text, prompt ids and the needle's character offset."""

    length: int
    depth: float
    spec: Any
    prompt: str
    ids: list[int]
    needle_at: int


@dataclass
class TestPlan:
    """How a :class:`NeedleScorer` scores one test.

    Attributes:
        span: the scored prompt span ``[s, e)`` (None: nothing is scored, the test still decodes)
        steps: decoding steps
        score_step: ``(token, attention [layers, q_heads, keys]) -> one [layers, q_heads] increment per score``
    """

    span: tuple[int, int] | None
    steps: int
    score_step: Callable[[int, torch.Tensor], Sequence[torch.Tensor]]


class NeedleScorer(Protocol):
    """What a head detection scores (HeadKV: retrieval-reasoning and retrieval; CompressKV: SRH and TRH)."""

    names: tuple[str, ...]  # the per-step scores, in the order ``score_step`` returns them
    label: str  # progress-bar name of the tests that count

    def plan(self, tokenizer: Any, test: NeedleTest) -> TestPlan:
        """The span, step count and step scorer of ``test``."""
        ...

    def judge(self, test: NeedleTest, plan: TestPlan, response: str) -> tuple[float, bool, dict[str, Any]]:
        """``(quality score, whether the test counts, fields added to its record)`` of the decoded response."""
        ...


@dataclass
class NeedleHeadScores:
    """What :func:`detect_needle_heads` found.

    Attributes:
        per_test: score name -> ``[tests, layers, q_heads]`` per-test sums over decoding steps
        quality: ``[tests]`` the scorer's quality score of each response
        counted: ``[tests]`` bool, the tests the scorer counts
        records: one dict per test (length, depth, needle, prompt tokens, span, response, the scorer's fields)
        run: the needle run (grid, template, geometry)
    """

    per_test: dict[str, torch.Tensor]
    quality: torch.Tensor
    counted: torch.Tensor
    records: list[dict[str, Any]]
    run: NeedleRun

    def mean(self, name: str) -> torch.Tensor:
        """``[layers, q_heads]`` mean of score ``name`` over the counted tests (zeros when none counts)."""
        scores = self.per_test[name]
        if self.counted.any():
            return scores[self.counted].mean(0)
        return torch.zeros(scores.shape[1:])


def detect_needle_heads(
    model: torch.nn.Module, tokenizer: Any, run: NeedleRun, scorer: NeedleScorer, desc: str, progress: bool = True
) -> NeedleHeadScores:
    """Decode every test of ``run`` with attention and sum ``scorer``'s per-step head scores over its steps."""
    from tqdm.auto import tqdm

    tests = len(run.grid)
    per_test = {name: torch.zeros(tests, run.layers, run.heads) for name in scorer.names}
    quality = torch.zeros(tests)
    counted = torch.zeros(tests, dtype=torch.bool)
    records: list[dict[str, Any]] = []
    bar = tqdm(run.grid, desc=desc, unit="test", disable=not progress, dynamic_ncols=True)
    for i, (length, depth, spec) in enumerate(bar):
        prompt, ids, needle_at = needle_prompt(
            tokenizer, run.template, run.hay, spec.needle, spec.question, spec.answer_prefix, length, depth, run.periods
        )
        test = NeedleTest(length, depth, spec, prompt, ids, needle_at)
        plan = scorer.plan(tokenizer, test)
        sums = [torch.zeros(run.layers, run.heads) for _ in scorer.names]

        def on_step(token: int, att: torch.Tensor, plan=plan, sums=sums) -> None:
            if plan.span is None:
                return
            for total, increment in zip(sums, plan.score_step(token, att), strict=True):
                total += increment

        generated = greedy_decode_with_attention(model, tokenizer, ids, plan.steps, run.eos, run.newline, on_step)
        response = tokenizer.decode(generated, skip_special_tokens=True).strip()
        score, ok, fields = scorer.judge(test, plan, response)
        for name, total in zip(scorer.names, sums, strict=True):
            per_test[name][i] = total
        quality[i], counted[i] = score, ok
        records.append(
            {
                "length": length,
                "depth": depth,
                "needle": spec.name,
                "prompt_tokens": len(ids),
                "span": None if plan.span is None else list(plan.span),
                "response": response,
                **fields,
            }
        )
        bar.set_postfix({scorer.label: f"{int(counted[: i + 1].sum())}/{i + 1}"})
    return NeedleHeadScores(per_test, quality, counted, records, run)
