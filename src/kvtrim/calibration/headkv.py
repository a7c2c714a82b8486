"""Retrieval–reasoning head detection ("R2", HeadKV) and the ``headkv`` calibration artifact.

Follows ``retrieval_head_detection_r2.py`` of FYYFU/HeadKV:

* **Tests.** Needle-in-a-haystack prompts over a grid of context lengths × depths. Each needle holds two facts
  plus ages ("Mary is 13 years old and her favorite thing is ... John is 12 years old and ..."); the
  *reasoning* question asks for "the favorite thing of the older one between John and Mary". The scored
  span is the sentence holding the answer (``real_needle`` in the reference). The haystack is natural prose
  (the Jargon File, :func:`kvtrim.eval.haystacks.get_haystack`), the prompt uses the model's chat template with
  context and question in the user turn, and an *answer prefix* opens the assistant turn (the reference's
  completion prompt ends in ``Answer:``; a chat model restates the question first, which would use up the
  few decoding steps).
* **Decoding.** The prompt minus its last token is prefilled; then greedy decoding feeds that last token and
  each generated token, for at most ``len(answer tokens)`` steps (stopping at EOS or a newline), with eager
  attention so every step returns its attention rows.
* **Retrieval–reasoning score.** At each step, for each (layer, query head), take the ``k = |span|`` most
  attended positions; each one inside the span adds ``attention / (|span| · |answer tokens|)`` (no copy
  condition). The ``1/|answer tokens|`` factor is the reference code's (it makes needles with different answer
  lengths comparable; its extra constant ×10 is dropped).
* **Retrieval score** (Retrieval_Head criterion, from the same runs): a step adds ``1/|span|`` when the head's
  top-1 position lies inside the span *and* the generated token equals the token there.
* **Kept tests.** A test counts only if ``qa_f1_score(response, answer) > min_f1`` (0.5); a head's score is
  the mean of its per-test scores over the kept tests.

Besides HeadKV's reasoning question, each needle is also asked *directly* ("What is Mary's favorite
thing?"): the same two-fact needle and span, but the model only has to pick the right one of two facts.
Small models (the embedded SmolLM2-135M answers essentially none of the age-comparison questions) then still
produce kept tests; the artifact records how many tests of each kind were kept and the scores per test, so
the reasoning-only scores can be recomputed (``per_test_*`` tensors with ``tests_kept`` and ``question_kind``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.store import model_display_name, save_artifact
from kvtrim.calibration.needles import (
    NeedleTest,
    TestPlan,
    char_span_tokens,
    depth_grid,
    detect_needle_heads,
    prepare_needle_run,
)
from kvtrim.errors import InvalidParameterError, KVTrimError

__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_NEEDLES",
    "HEADKV_KIND",
    "QUESTION_KINDS",
    "HeadDetection",
    "NeedleSpec",
    "RetrievalReasoningScorer",
    "calibrate_headkv",
    "depth_grid",
    "detect_heads",
    "two_fact_needles",
]

HEADKV_KIND = "headkv"
DEFAULT_LENGTHS: tuple[int, ...] = (300, 600, 900, 1200)
"""Context lengths (haystack + needle tokens): ``linspace(300, 1200, 4)``. The embedded SmolLM2-135M retrieves
reliably only up to about 1.2k tokens; the reference uses ``linspace(0, 10000, 5)`` for 8B models."""
DEFAULT_DEPTHS = 10
"""Number of needle depths, ``round(linspace(0, 100, n))`` percent."""
QUESTION_KINDS = ("reasoning", "direct")


@dataclass(frozen=True)
class NeedleSpec:
    """One needle and the question asked about it.

    Attributes:
        name: short identifier (recorded per test)
        needle: text inserted into the haystack (two facts plus ages)
        span: the sentence of ``needle`` that holds the answer; its tokens are the scored span
        question: asked in the user turn after the context
        answer: the expected answer (QA-F1 reference)
        answer_prefix: text opening the assistant turn (may be empty)
        kind: ``"reasoning"`` (needs the age comparison) or ``"direct"`` (names the person)
    """

    name: str
    needle: str
    span: str
    question: str
    answer: str
    answer_prefix: str = ""
    kind: str = "reasoning"


def two_fact_needles(
    older: tuple[str, int, str, str], younger: tuple[str, int, str, str], older_first: bool, name: str
) -> list[NeedleSpec]:
    """A reasoning and a direct :class:`NeedleSpec` for two people ``(name, age, possessive, favorite thing)``."""

    def sentence(person: tuple[str, int, str, str]) -> str:
        who, age, pronoun, thing = person
        return f"{who} is {age} years old and {pronoun} favorite thing is {thing}."

    first, second = (older, younger) if older_first else (younger, older)
    needle = f" {sentence(first)} {sentence(second)}"
    pair = f"{second[0]} and {first[0]}"
    reasoning_q = f"What is the favorite thing of the older one between {pair}?"
    return [
        NeedleSpec(
            name=f"{name}-reasoning",
            needle=needle,
            span=sentence(older),
            question=reasoning_q,
            answer=older[3],
            answer_prefix=f"The favorite thing of the older one between {pair} is",
            kind="reasoning",
        ),
        NeedleSpec(
            name=f"{name}-direct",
            needle=needle,
            span=sentence(older),
            question=f"What is {older[0]}'s favorite thing?",
            answer=older[3],
            answer_prefix=f"{older[0]}'s favorite thing is",
            kind="direct",
        ),
    ]


DEFAULT_NEEDLES: tuple[NeedleSpec, ...] = tuple(
    two_fact_needles(("Mary", 13, "her", "swimming in the lake"), ("John", 12, "his", "playing chess"), True, "mary")
    + two_fact_needles(
        ("Emma", 11, "her", "painting wild birds"), ("Lucas", 9, "his", "building sand castles"), False, "emma"
    )
    + two_fact_needles(
        ("Noah", 15, "his", "fixing old radios"), ("Olivia", 14, "her", "baking apple pies"), True, "noah"
    )
    + two_fact_needles(
        ("Sofia", 10, "her", "reading comic books"), ("Ethan", 8, "his", "feeding the ducks"), False, "sofia"
    )
)
"""Four two-person needles, each asked as a reasoning and as a direct question (kvtrim's own texts)."""


@dataclass
class HeadDetection:
    """Scores from :func:`detect_heads`.

    Attributes:
        retrieval_reasoning: ``[layers, q_heads]`` mean R2 score over kept tests (zeros when none kept)
        retrieval: ``[layers, q_heads]`` mean retrieval-head score over kept tests
        per_test_retrieval_reasoning, per_test_retrieval: ``[tests, layers, q_heads]``
        f1: ``[tests]`` QA-F1 of each response
        kept: ``[tests]`` bool, ``f1 > min_f1``
        records: one dict per test (length, depth, needle, kind, response, f1, kept, prompt tokens, span)
        seconds: wall time
        settings: the detection settings
    """

    retrieval_reasoning: torch.Tensor
    retrieval: torch.Tensor
    per_test_retrieval_reasoning: torch.Tensor
    per_test_retrieval: torch.Tensor
    f1: torch.Tensor
    kept: torch.Tensor
    records: list[dict[str, Any]]
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tests(self) -> int:
        return int(self.kept.numel())

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    def kept_by_kind(self) -> dict[str, list[int]]:
        """``kind -> [kept, total]``."""
        out: dict[str, list[int]] = {}
        for rec in self.records:
            entry = out.setdefault(rec["kind"], [0, 0])
            entry[0] += int(rec["kept"])
            entry[1] += 1
        return out


# ---------------------------------------------------------------------------------------------------- detection
@dataclass
class RetrievalReasoningScorer:
    """HeadKV's per-step scores (R2 and retrieval, see the module notes) for :func:`detect_needle_heads`; a test
    counts when ``qa_f1_score(response, answer) > min_f1``."""

    min_f1: float = 0.5
    names: tuple[str, ...] = ("retrieval_reasoning", "retrieval")
    label: str = "kept"

    def plan(self, tokenizer: Any, test: NeedleTest) -> TestPlan:
        spec, ids = test.spec, test.ids
        char_start = test.needle_at + spec.needle.index(spec.span)
        start, end = char_span_tokens(tokenizer, test.prompt, ids, char_start, char_start + len(spec.span), spec.span)
        answer_tokens = len(tokenizer(" " + spec.answer, add_special_tokens=False)["input_ids"])
        k = end - start
        token_at = torch.tensor(ids + [-1] * (answer_tokens + 1))

        def score_step(token: int, att: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            vals, idx = att.topk(min(k, att.shape[-1]), dim=-1)
            inside = (idx >= start) & (idx < end)
            r2 = (vals * inside).sum(-1) / (k * answer_tokens)
            copy = inside[..., 0] & (token_at[idx[..., 0]] == token)
            return r2, copy.float() / k

        return TestPlan((start, end), answer_tokens, score_step)

    def judge(self, test: NeedleTest, plan: TestPlan, response: str) -> tuple[float, bool, dict[str, Any]]:
        from kvtrim.eval.metrics import qa_f1_score

        score = float(qa_f1_score(response, [test.spec.answer]))
        keep = score > self.min_f1
        return score, keep, {"kind": test.spec.kind, "f1": round(score, 4), "kept": keep}


def detect_heads(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: int | Sequence[float] = DEFAULT_DEPTHS,
    needles: Sequence[NeedleSpec] = DEFAULT_NEEDLES,
    haystack: str = "jargon",
    seed: int = 0,
    min_f1: float = 0.5,
    use_chat_template: bool = True,
    progress: bool = True,
) -> HeadDetection:
    """Run the R2 / retrieval head detection over ``lengths × depths × needles`` (see the module notes).

    Args:
        lengths: context lengths in tokens (haystack + needle, without the chat template and question)
        depths: number of depths (``round(linspace(0, 100, n))``) or a list of percentages
        needles: the needles and questions
        haystack: a :func:`~kvtrim.eval.haystacks.get_haystack` name or file
        seed: picks where in the haystack text the contexts start (0: at its beginning)
        min_f1: keep tests whose QA-F1 exceeds this (the reference's 0.5; −1 keeps every test)
        use_chat_template: wrap the prompt in the tokenizer's chat template when it has one
    """
    needles = list(needles)
    for spec in needles:
        if spec.span not in spec.needle:
            raise InvalidParameterError(f"needle {spec.name!r}: span {spec.span!r} is not part of its needle text")
    run = prepare_needle_run(model, tokenizer, lengths, depths, needles, haystack, seed, use_chat_template)
    found = detect_needle_heads(model, tokenizer, run, RetrievalReasoningScorer(min_f1), "headkv calibration", progress)
    settings = {
        "lengths": run.lengths,
        "depths": run.depths,
        "haystack": haystack,
        "haystack_start_char": run.haystack_start,
        "seed": seed,
        "min_f1": min_f1,
        "use_chat_template": bool(use_chat_template and run.template.prefix != ""),
        "needles": [asdict(spec) for spec in needles],
        "decode_steps": "len(answer tokens)",
        "r2_rule": "top-|span| positions inside the span add attention/(|span|*|answer tokens|); no copy condition",
        "retrieval_rule": "top-1 inside the span and generated token == token there adds 1/|span|",
        "keep_rule": f"qa_f1_score(response, answer) > {min_f1}",
    }
    return HeadDetection(
        retrieval_reasoning=found.mean("retrieval_reasoning"),
        retrieval=found.mean("retrieval"),
        per_test_retrieval_reasoning=found.per_test["retrieval_reasoning"],
        per_test_retrieval=found.per_test["retrieval"],
        f1=found.quality,
        kept=found.counted,
        records=found.records,
        seconds=time.perf_counter() - run.started,
        settings=settings,
    )


def calibrate_headkv(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: int | Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
    out_dir: str | Path | None = None,
    min_f1: float = 0.5,
    needles: Sequence[NeedleSpec] = DEFAULT_NEEDLES,
    haystack: str = "jargon",
    use_chat_template: bool = True,
    progress: bool = True,
) -> Path:
    """Detect retrieval–reasoning heads and save the ``headkv`` artifact; return its ``.safetensors`` path.

    Tensors: ``retrieval_reasoning`` and ``retrieval`` ``[layers, q_heads]`` float32 (means over kept tests),
    ``per_test_retrieval_reasoning`` / ``per_test_retrieval`` ``[tests, layers, q_heads]``, ``tests_kept``
    ``[tests]`` bool, ``test_f1`` ``[tests]``. The metadata holds the grid, needles, per-test records,
    ``summary`` (tests, kept, kept per question kind) and the wall time. Arguments as :func:`detect_heads`;
    ``out_dir`` defaults to ``$KVTRIM_HOME/artifacts``.

    Raises:
        KVTrimError: no test was answered well enough to be kept (the scores would be undefined)
    """
    det = detect_heads(model, tokenizer, lengths, depths, needles, haystack, seed, min_f1, use_chat_template, progress)
    if det.n_kept == 0:
        raise KVTrimError(
            f"headkv calibration kept none of its {det.n_tests} tests (no response had QA-F1 > {min_f1}); the model "
            "does not answer these needle questions, so head scores would be undefined. Try shorter --lengths."
        )
    kinds = [QUESTION_KINDS.index(r["kind"]) if r["kind"] in QUESTION_KINDS else -1 for r in det.records]
    tensors = {
        "retrieval_reasoning": det.retrieval_reasoning.float(),
        "retrieval": det.retrieval.float(),
        "per_test_retrieval_reasoning": det.per_test_retrieval_reasoning.float(),
        "per_test_retrieval": det.per_test_retrieval.float(),
        "tests_kept": det.kept.clone(),
        "test_f1": det.f1.float(),
        "question_kind": torch.tensor(kinds, dtype=torch.int8),
    }
    meta = {
        "description": "HeadKV retrieval-reasoning (R2) and retrieval head scores per (layer, query head)",
        "primary_tensor": "retrieval_reasoning",
        "settings": det.settings,
        "summary": {
            "tests": det.n_tests,
            "kept": det.n_kept,
            "kept_by_kind": det.kept_by_kind(),
            "mean_f1": round(float(det.f1.mean()), 4) if det.n_tests else math.nan,
            "model": model_display_name(model),
            "torch_threads": torch.get_num_threads(),
        },
        "question_kinds": list(QUESTION_KINDS),
        "tests": det.records,
        "seconds": round(det.seconds, 1),
    }
    return save_artifact(HEADKV_KIND, model, tensors, meta, out_dir)
