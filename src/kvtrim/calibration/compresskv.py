"""CompressKV calibration (Lin et al., arXiv 2508.02401): semantic / copy-paste retrieval head scores and the
error-aware layer profile, saved as the ``compresskv`` artifact.

**Offline A: head scores** (``semantic_retrieval_head_detection.py`` / ``retrieval_head_detection.py`` of
TUDa-HWAI/CompressKV):

* *Tests.* Needle-in-a-haystack over ``lengths × depths × needles``. Each needle has a question and an *answer
  span* (``real_needle``): the part of the needle that answers it. Prompts use the model's chat template with
  context and question in one user turn and an answer prefix opening the assistant turn (the reference feeds raw
  text to base-style models; the embedded model is instruction-tuned, as for kvtrim's HeadKV calibration).
* *Answer span* ``[s, e)``: the first window of the prompt whose token set overlaps the answer's token set by
  more than 0.9 (the answer is tokenized with and without a leading space; the earlier match wins).
* *Decoding.* Greedy, at most 50 steps, stopping at a newline (after some text) or EOS; attention per layer and
  query head from the query that produced each token (:mod:`kvtrim.calibration.needles`).
* *SRH, paper eq. 5.* When the generated token equals the prompt token at a position ``i ∈ [s, e)``, every
  (layer, query head) adds its attention mass over the whole span, ``Σ_{k∈[s,e)} A[k]``, once per matching span
  position (an answer token occurring twice in the span adds the mass twice; decision 7 (docs/decisions.md)).
* *TRH (Retrieval_Head).* When a head's top-1 attended position ``i`` lies in ``[s, e)`` and the generated token
  equals ``prompt[i]``, the head adds ``1/(e − s)``.
* *Filter.* A test counts only if ROUGE-1 recall (stemmed, ``rouge-score``) of the response against the answer
  span exceeds 0.5; a head's score is the mean of its per-test sums over the counted tests.

**Offline B: layer error profile** (``pred_get_importance_score.py``, eq. 8–12): on calibration tasks generated
by kvtrim's own task generators (seeds disjoint from the evaluation seed 42), each prompt is compressed
question-aware with a uniform budget of 32 entries per layer (24 selected with the SRH selection rule + the
8-token window), and decoded greedily with the *full* cache. At every decoding step and layer the attention output
(after ``o_proj``) over the compressed set (selected prompt entries + every generated token) is compared with the
full one: ``‖o_comp − o_full‖_F / (‖o_full‖_F + 1e-5)``, summed over steps and samples. Each task's vector is
normalised to sum 1; the tasks are averaged and renormalised: ``layer_scores`` = ``e_l``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.compresskv import COMPRESSKV_KIND, load_compresskv
from kvtrim.artifacts.store import Artifact, model_display_name, save_artifact
from kvtrim.calibration.needles import NeedleTest, TestPlan, detect_needle_heads, prepare_needle_run
from kvtrim.errors import InvalidParameterError, KVTrimError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.runtime import eos_ids, greedy_decode

__all__ = [
    "COMPRESSKV_KIND",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_NEEDLES",
    "DEFAULT_PROFILE_TASKS",
    "AnswerNeedle",
    "HeadScores",
    "LayerProfile",
    "RetrievalHeadScorer",
    "calibrate_compresskv",
    "detect_retrieval_heads",
    "find_answer_span",
    "load_compresskv",
    "normalize_layer_errors",
    "plot_compresskv",
    "profile_layer_errors",
    "rouge1_recall",
    "srh_step_scores",
    "trh_step_scores",
]

DEFAULT_LENGTHS: tuple[int, ...] = (300, 600, 900, 1200)
"""Context lengths in tokens. SmolLM2-135M retrieves reliably only up to ~1.2k tokens; the reference uses 20
lengths from 1k to 31.5k–50k tokens for 7–8B models."""
DEFAULT_DEPTHS = 10
"""Needle depths ``round(linspace(0, 100, 10))`` percent, as the reference."""
DEFAULT_MAX_NEW_TOKENS = 50
DEFAULT_MIN_RECALL = 0.5
SPAN_OVERLAP = 0.9
DEFAULT_PROFILE_TASKS: tuple[str, ...] = ("passkey", "niah_single_1", "niah_single_2", "niah_multikey_1", "vt", "fwe")
"""Calibration tasks of the layer profile (kvtrim's generators stand in for LongBench, which is not shipped)."""
DEFAULT_PROFILE_SAMPLES = 4
DEFAULT_PROFILE_LENGTH = 1024
DEFAULT_PROFILE_SEED = 1234
"""Task seed of the layer profile; the evaluation harness uses 42, and samples are keyed by (task, seed, index)."""
PROFILE_BUDGET = 32
PROFILE_WINDOW = 8
PROFILE_KERNEL = 5
HEADS_PER_LAYER = 4


@dataclass(frozen=True)
class AnswerNeedle:
    """A needle, the question asked about it and the span of it that answers the question.

    Attributes:
        name: short identifier (recorded per test)
        needle: text inserted into the haystack
        answer: the answer span (``real_needle``), a substring of ``needle``; scored span and ROUGE reference
        question: asked after the context
        answer_prefix: text opening the assistant turn (may be empty)
    """

    name: str
    needle: str
    answer: str
    question: str
    answer_prefix: str = ""


DEFAULT_NEEDLES: tuple[AnswerNeedle, ...] = (
    AnswerNeedle(
        "soup",
        " The secret ingredient of the island's famous fish soup is roasted sea fennel picked on the northern cliffs.",
        "roasted sea fennel picked on the northern cliffs",
        "What is the secret ingredient of the island's famous fish soup?",
        "The secret ingredient of the island's famous fish soup is",
    ),
    AnswerNeedle(
        "bay",
        " The old harbour pilot says the safest way across the bay is to follow the red buoys at dawn.",
        "follow the red buoys at dawn",
        "According to the old harbour pilot, what is the safest way across the bay?",
        "The safest way across the bay is to",
    ),
    AnswerNeedle(
        "patel",
        " Mr Patel is admired by everyone on his street because he repairs broken bicycles for free.",
        "he repairs broken bicycles for free",
        "Why is Mr Patel admired by everyone on his street?",
        "Mr Patel is admired because",
    ),
    AnswerNeedle(
        "library",
        " The town council announced that the new public library will open on the first Monday of September.",
        "the first Monday of September",
        "When will the new public library open?",
        "The new public library will open on",
    ),
)
"""kvtrim's own needles (the reference uses a climate-report sentence, a city tip and a dislike statement)."""


# ---------------------------------------------------------------------------------------------------- scoring
def find_answer_span(prompt_ids: Sequence[int], answer_ids: Sequence[int], threshold: float = SPAN_OVERLAP):
    """``(s, e)`` of the first window of ``len(answer_ids)`` prompt tokens whose token *set* covers more than
    ``threshold`` of the answer's token set (Retrieval_Head's ``find_needle_idx``), or None."""
    want = set(answer_ids)
    n = len(answer_ids)
    if not want:
        return None
    for i in range(len(prompt_ids) - n + 1):
        if len(want & set(prompt_ids[i : i + n])) / len(want) > threshold:
            return i, i + n
    return None


def answer_span(tokenizer: Any, prompt_ids: Sequence[int], answer: str) -> tuple[int, int] | None:
    """The answer span of ``answer`` in ``prompt_ids``, trying the answer with and without a leading space (BPE
    tokenizers encode a word differently after a space); the earliest match wins."""
    found = []
    for text in (" " + answer, answer):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        span = find_answer_span(prompt_ids, ids)
        if span is not None:
            found.append(span)
    return min(found) if found else None


def srh_step_scores(attention: torch.Tensor, token: int, prompt_ids: torch.Tensor, span: tuple[int, int]):
    """Eq. 5 increment of one decoding step, ``[layers, q_heads]``.

    Args:
        attention: ``[layers, q_heads, keys]`` attention of the query that produced ``token``
        prompt_ids: ``[n]`` prompt token ids
        span: answer span ``[s, e)`` in prompt positions
    Returns ``count · Σ_{k∈[s,e)} attention[..., k]`` with ``count`` = how many span positions hold ``token``.
    """
    s, e = span
    count = int((prompt_ids[s:e] == token).sum())
    if count == 0:
        return attention.new_zeros(attention.shape[:-1])
    return count * attention[..., s:e].sum(-1)


def trh_step_scores(attention: torch.Tensor, token: int, prompt_ids: torch.Tensor, span: tuple[int, int]):
    """Retrieval-head increment of one step, ``[layers, q_heads]``: ``1/(e − s)`` where the head's top-1 position
    ``i`` lies in ``[s, e)`` and ``prompt_ids[i] == token``, else 0. Arguments as :func:`srh_step_scores`."""
    s, e = span
    top = attention.argmax(-1)
    inside = (top >= s) & (top < e)
    copied = prompt_ids[top.clamp(max=prompt_ids.numel() - 1)] == token
    return (inside & copied).to(attention.dtype) / (e - s)


@functools.lru_cache(maxsize=1)
def _rouge1() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1_recall(response: str, reference: str) -> float:
    """ROUGE-1 recall (stemmed) of ``response`` against ``reference`` (the answer span); 0 for an empty response."""
    if not response.strip():
        return 0.0
    return float(_rouge1().score(reference, response)["rouge1"].recall)


# ---------------------------------------------------------------------------------------------------- offline A
@dataclass
class HeadScores:
    """Scores from :func:`detect_retrieval_heads`.

    Attributes:
        srh, trh: ``[layers, q_heads]`` means over successful tests (zeros when none succeeded)
        per_test_srh, per_test_trh: ``[tests, layers, q_heads]`` per-test sums
        recall: ``[tests]`` ROUGE-1 recall of each response against its answer span
        success: ``[tests]`` bool: span found and recall above the threshold
        records: one dict per test (length, depth, needle, response, recall, span, success)
        seconds: wall time
        settings: the detection settings
    """

    srh: torch.Tensor
    trh: torch.Tensor
    per_test_srh: torch.Tensor
    per_test_trh: torch.Tensor
    recall: torch.Tensor
    success: torch.Tensor
    records: list[dict[str, Any]]
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tests(self) -> int:
        return int(self.success.numel())

    @property
    def n_success(self) -> int:
        return int(self.success.sum())


@dataclass
class RetrievalHeadScorer:
    """CompressKV's per-step scores (SRH, eq. 5, and TRH) for :func:`detect_needle_heads`; a test counts when its
    answer span was found and the response's ROUGE-1 recall exceeds ``min_recall``."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_recall: float = DEFAULT_MIN_RECALL
    names: tuple[str, ...] = ("srh", "trh")
    label: str = "ok"

    def plan(self, tokenizer: Any, test: NeedleTest) -> TestPlan:
        span = answer_span(tokenizer, test.ids, test.spec.answer)
        prompt_ids = torch.tensor(test.ids)

        def score_step(token: int, att: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return srh_step_scores(att, token, prompt_ids, span), trh_step_scores(att, token, prompt_ids, span)

        return TestPlan(span, self.max_new_tokens, score_step)

    def judge(self, test: NeedleTest, plan: TestPlan, response: str) -> tuple[float, bool, dict[str, Any]]:
        score = rouge1_recall(response, test.spec.answer)
        ok = plan.span is not None and score > self.min_recall
        return score, ok, {"rouge1_recall": round(score, 4), "success": bool(ok)}


def detect_retrieval_heads(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: int | Sequence[float] = DEFAULT_DEPTHS,
    needles: Sequence[AnswerNeedle] = DEFAULT_NEEDLES,
    haystack: str = "jargon",
    seed: int = 0,
    min_recall: float = DEFAULT_MIN_RECALL,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    use_chat_template: bool = True,
    progress: bool = True,
) -> HeadScores:
    """SRH (eq. 5) and TRH scores over ``lengths × depths × needles`` needle tests (see the module notes).

    Args:
        lengths: context lengths in tokens (haystack + needle, without template and question)
        depths: number of depths (``round(linspace(0, 100, n))``) or a list of percentages
        haystack: a :func:`~kvtrim.eval.haystacks.get_haystack` name or ``file:PATH``
        seed: picks where in the haystack text the contexts start (0: at its beginning)
        min_recall: a test counts when ROUGE-1 recall exceeds this (0.5; −1 counts every test with a span)
        max_new_tokens: decoding steps per test (50)
    """
    needles = list(needles)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidParameterError(f"max_new_tokens={max_new_tokens!r}: give a positive integer")
    for spec in needles:
        if not spec.answer.strip() or spec.answer not in spec.needle:
            raise InvalidParameterError(f"needle {spec.name!r}: answer {spec.answer!r} is not part of its needle")
    run = prepare_needle_run(model, tokenizer, lengths, depths, needles, haystack, seed, use_chat_template)
    scorer = RetrievalHeadScorer(max_new_tokens, min_recall)
    found = detect_needle_heads(model, tokenizer, run, scorer, "compresskv heads", progress)
    settings = {
        "lengths": run.lengths,
        "depths": run.depths,
        "haystack": haystack,
        "haystack_start_char": run.haystack_start,
        "seed": seed,
        "min_recall": min_recall,
        "max_new_tokens": max_new_tokens,
        "use_chat_template": bool(use_chat_template and run.template.prefix != ""),
        "needles": [asdict(spec) for spec in needles],
        "span_rule": f"first prompt window whose token set covers > {SPAN_OVERLAP} of the answer's token set",
        "srh_rule": "generated token == prompt token at i in span adds the attention mass over the span, "
        "once per matching position (eq. 5)",
        "trh_rule": "top-1 position in span and generated token == token there adds 1/(e-s)",
        "success_rule": f"ROUGE-1 recall (stemmed) of the response vs the answer span > {min_recall}",
    }
    return HeadScores(
        srh=found.mean("srh"),
        trh=found.mean("trh"),
        per_test_srh=found.per_test["srh"],
        per_test_trh=found.per_test["trh"],
        recall=found.quality,
        success=found.counted,
        records=found.records,
        seconds=time.perf_counter() - run.started,
        settings=settings,
    )


# ---------------------------------------------------------------------------------------------------- offline B
def normalize_layer_errors(per_task: torch.Tensor) -> torch.Tensor:
    """Eq. 10–12: normalise each task's ``[layers]`` error vector to sum 1, average over tasks (tasks whose
    errors are all zero are skipped), renormalise (L1). ``per_task``: ``[tasks, layers]``; returns ``[layers]``."""
    per_task = torch.as_tensor(per_task, dtype=torch.float64)
    if per_task.dim() != 2 or per_task.shape[1] == 0:
        raise InvalidParameterError(f"per_task must be [tasks, layers], got {tuple(per_task.shape)}")
    sums = per_task.sum(1, keepdim=True)
    usable = sums.squeeze(1) > 0
    if not bool(usable.any()):
        raise KVTrimError("every calibration task had zero layer error: the profile is undefined")
    avg = (per_task[usable] / sums[usable]).mean(0)
    return avg / avg.sum()


@dataclass
class LayerProfile:
    """Result of :func:`profile_layer_errors`.

    Attributes:
        layer_scores: ``[layers]`` normalised, averaged errors ``e_l`` (sums to 1)
        per_task: ``[tasks, layers]`` errors summed over steps and samples (not normalised)
        tasks: task names (rows of ``per_task``)
        records: one dict per sample (task, index, prompt tokens, decode steps, response)
        seconds: wall time
        settings: the profiling settings
    """

    layer_scores: torch.Tensor
    per_task: torch.Tensor
    tasks: list[str]
    records: list[dict[str, Any]]
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)


def profile_layer_errors(
    model: torch.nn.Module,
    tokenizer: Any,
    heads: torch.Tensor,
    tasks: Sequence[str] = DEFAULT_PROFILE_TASKS,
    samples: int = DEFAULT_PROFILE_SAMPLES,
    length: int = DEFAULT_PROFILE_LENGTH,
    seed: int = DEFAULT_PROFILE_SEED,
    budget: int = PROFILE_BUDGET,
    window: int = PROFILE_WINDOW,
    kernel: int = PROFILE_KERNEL,
    haystack: str | None = None,
    use_chat_template: bool = True,
    progress: bool = True,
) -> LayerProfile:
    """Eq. 8–12: per-layer attention-output error of a uniform ``budget`` compression with the head-subset
    selection of ``heads`` (``[layers, k]``), summed over decoding steps (full-cache decoding) and samples.

    Args:
        tasks: :func:`kvtrim.eval.tasks.generate_task` names; ``samples`` prompts of ``length`` tokens each
        seed: task seed (keep it different from the evaluation seed 42)
    """
    from tqdm.auto import tqdm

    from kvtrim.budgets.uniform import UniformBudget
    from kvtrim.compression.pipeline import Pipeline
    from kvtrim.eval.fidelity import capture_decoding_queries, layer_errors, prefill
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template
    from kvtrim.scoring.head_subset import HeadSubsetScorer
    from kvtrim.selection.topk import TopKSelector

    tasks = list(tasks)
    if not tasks:
        raise InvalidParameterError("tasks=[]: give at least one calibration task")
    if samples <= 0 or length <= 0 or budget <= window:
        raise InvalidParameterError(
            f"need samples > 0, length > 0 and budget > window (got {samples}, {length}, {budget}, {window})"
        )
    started = time.perf_counter()
    pipeline = Pipeline(
        "compresskv_profile",
        HeadSubsetScorer(heads, window=window, kernel=kernel, pooling="avg"),
        UniformBudget(),
        TopKSelector(recent=window),
        {"budget": budget, "window": window, "kernel": kernel},
    )
    template = prompt_template(tokenizer, use_chat_template)
    special = template.prefix == ""
    eos = eos_ids(model, tokenizer)
    layers = int(model.config.num_hidden_layers)
    per_task = torch.zeros(len(tasks), layers, dtype=torch.float64)
    records: list[dict[str, Any]] = []
    work = [(t, s) for t in tasks for s in generate_task(t, tokenizer, length, samples, seed=seed, haystack=haystack)]
    bar = tqdm(work, desc="compresskv layer profile", unit="prompt", disable=not progress, dynamic_ncols=True)
    for task, sample in bar:
        prompt = template.context_part(sample.context) + template.question_part(sample.question, sample.answer_prefix)
        ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
        pre = prefill(model, ids, methods=[pipeline])
        compressed = pre.compressed_cache(pipeline, budget=budget)
        with torch.inference_mode(), kvtrim_attention_enabled(model):  # greedy decoding with the full cache
            decoded = greedy_decode(model, pre.full_cache(), pre.mask, pre.logits, sample.max_new_tokens, eos)
        generated = decoded.tokens[0]
        fed = generated[: decoded.steps]  # the last token chosen is not fed back
        if fed:
            errors = layer_errors(capture_decoding_queries(model, pre.cache, fed, pre.mask), compressed)
            per_task[tasks.index(task)] += errors.rel_per_query.double().sum(-1)
        records.append(
            {
                "task": task,
                "index": sample.index,
                "prompt_tokens": len(ids),
                "decode_steps": len(fed),
                "response": tokenizer.decode(generated, skip_special_tokens=True).strip(),
            }
        )
    settings = {
        "tasks": tasks,
        "samples_per_task": samples,
        "length": length,
        "task_seed": seed,
        "haystack": haystack or "task default",
        "budget": budget,
        "window": window,
        "kernel": kernel,
        "heads_per_layer": int(heads.shape[1]),
        "question_aware": True,
        "use_chat_template": bool(use_chat_template and template.prefix != ""),
        "error": "sum over decode steps of ||o_comp - o_full||_F / (||o_full||_F + 1e-5) after o_proj; compressed "
        "set = selected prompt entries + every generated token; decoding with the full cache",
        "aggregation": "per task normalised to sum 1, averaged over tasks, renormalised (L1)",
    }
    return LayerProfile(
        layer_scores=normalize_layer_errors(per_task).float(),
        per_task=per_task.float(),
        tasks=tasks,
        records=records,
        seconds=time.perf_counter() - started,
        settings=settings,
    )


# ---------------------------------------------------------------------------------------------------- artifact
def calibrate_compresskv(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: int | Sequence[float] = DEFAULT_DEPTHS,
    needles: Sequence[AnswerNeedle] = DEFAULT_NEEDLES,
    haystack: str = "jargon",
    seed: int = 0,
    min_recall: float = DEFAULT_MIN_RECALL,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    tasks: Sequence[str] = DEFAULT_PROFILE_TASKS,
    task_samples: int = DEFAULT_PROFILE_SAMPLES,
    task_length: int = DEFAULT_PROFILE_LENGTH,
    task_seed: int = DEFAULT_PROFILE_SEED,
    heads_per_layer: int = HEADS_PER_LAYER,
    out_dir: str | Path | None = None,
    use_chat_template: bool = True,
    progress: bool = True,
) -> Path:
    """Run offline A (head scores) then offline B (layer profile with the top ``heads_per_layer`` SRH heads) and
    save the ``compresskv`` artifact; return its ``.safetensors`` path.

    Tensors: ``srh``, ``trh`` ``[layers, q_heads]`` float32; ``srh_ranking``, ``trh_ranking`` ``[layers, q_heads]``
    int64 (heads of each layer by descending score); ``layer_scores`` ``[layers]`` (sums to 1);
    ``layer_errors_per_task`` ``[tasks, layers]``; ``per_test_srh``, ``per_test_trh`` ``[tests, layers, q_heads]``;
    ``test_success`` ``[tests]`` bool; ``test_rouge1_recall`` ``[tests]``. The metadata holds both settings, the
    per-test and per-sample records, ``summary`` (tests, successes, wall times) and the wall time.

    Raises:
        KVTrimError: no needle test succeeded (the head scores would be undefined)
    """
    from kvtrim.scoring.head_subset import top_heads_per_layer

    started = time.perf_counter()
    found = detect_retrieval_heads(
        model,
        tokenizer,
        lengths,
        depths,
        needles,
        haystack,
        seed,
        min_recall,
        max_new_tokens,
        use_chat_template,
        progress,
    )
    if found.n_success == 0:
        raise KVTrimError(
            f"compresskv calibration: none of its {found.n_tests} needle tests succeeded (ROUGE-1 recall > "
            f"{min_recall}); the model does not answer these needles, so head scores would be undefined. "
            "Try shorter --lengths."
        )
    heads = top_heads_per_layer(found.srh, heads_per_layer)
    profile = profile_layer_errors(
        model,
        tokenizer,
        heads,
        tasks,
        task_samples,
        task_length,
        task_seed,
        use_chat_template=use_chat_template,
        progress=progress,
    )
    tensors = {
        "srh": found.srh.float(),
        "trh": found.trh.float(),
        "srh_ranking": torch.argsort(found.srh.double(), dim=1, descending=True, stable=True),
        "trh_ranking": torch.argsort(found.trh.double(), dim=1, descending=True, stable=True),
        "layer_scores": profile.layer_scores.float(),
        "layer_errors_per_task": profile.per_task.float(),
        "per_test_srh": found.per_test_srh.float(),
        "per_test_trh": found.per_test_trh.float(),
        "test_success": found.success.clone(),
        "test_rouge1_recall": found.recall.float(),
    }
    seconds = time.perf_counter() - started
    meta = {
        "description": "CompressKV semantic retrieval head (SRH, eq. 5) and copy-paste retrieval head (TRH) scores "
        "per (layer, query head), and the error-aware layer scores e_l (eq. 8-12)",
        "paper": "Lin et al., Semantic Retrieval Heads Know What Tokens are Not Important Before Generation "
        "(CompressKV), arXiv 2508.02401",
        "primary_tensor": "srh",
        "settings": {"heads": found.settings, "layers": profile.settings, "profile_heads_per_layer": heads_per_layer},
        "summary": {
            "tests": found.n_tests,
            "successes": found.n_success,
            "mean_rouge1_recall": round(float(found.recall.mean()), 4) if found.n_tests else math.nan,
            "profile_prompts": len(profile.records),
            "profile_tasks": profile.tasks,
            "head_seconds": round(found.seconds, 1),
            "profile_seconds": round(profile.seconds, 1),
            "model": model_display_name(model),
            "torch_threads": torch.get_num_threads(),
        },
        "tests": found.records,
        "profile_samples": profile.records,
        "seconds": round(seconds, 1),
    }
    return save_artifact(COMPRESSKV_KIND, model, tensors, meta, out_dir)


def plot_compresskv(artifact: Artifact, target: str | Path) -> Path:
    """A figure of SRH and TRH scores (layer × query head heatmaps) and the layer scores ``e_l`` (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    srh, trh = artifact.tensors["srh"].float().numpy(), artifact.tensors["trh"].float().numpy()
    layer_scores = artifact.tensors["layer_scores"].float().numpy()
    layers, heads = srh.shape
    fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 0.9 * heads + 7.0), max(4.0, 0.22 * layers + 1.5)))
    for ax, data, title in ((axes[0], srh, "SRH (eq. 5)"), (axes[1], trh, "TRH (copy-paste)")):
        image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(heads))
        fig.colorbar(image, ax=ax)
    axes[2].barh(range(layers), layer_scores, color="tab:orange")
    axes[2].invert_yaxis()
    axes[2].set_xlabel("layer score e_l")
    axes[2].set_ylabel("layer")
    axes[2].set_title("error-aware layer scores", fontsize=9)
    fig.suptitle(f"{artifact.meta.get('model_key')}  compresskv", fontsize=10)
    fig.tight_layout()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
