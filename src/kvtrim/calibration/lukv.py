"""LU-KV budget curves (the ``lukv`` artifact): per-head keep fractions for a grid of compression ratios.

LU-KV (Tang et al., arXiv 2602.08585) profiles offline how much *future* utility each (layer, KV head) retains
when it keeps its top-b entries under a given scorer, and allocates a global budget across heads by marginal
utility: each head's retained-utility curve is relaxed to its concave hull (non-convex otherwise) and a greedy
solver takes hull segments across heads in decreasing marginal utility until the budget is spent. The per-head
keep fractions, averaged over calibration prompts, form a curve per ratio that
:class:`~kvtrim.budgets.utility_curves.UtilityCurveBudget` reads at deployment.

kvtrim's procedure (:func:`calibrate_lukv`), per calibration prompt (a synthetic task of kvtrim split into its
context and its question followed by the gold answer):

1. **Scores.** The context is prefilled into a kvtrim cache and the ``lukv`` method's scorer (kvpress's default,
   expected attention with ε = 0.02) scores every (layer, KV head, entry); the ``sink`` first and ``window`` last
   entries are protected (kept first, as the selector does).
2. **Future utility (the oracle).** The whole prompt is run with full attention; an entry's utility in a KV head is
   the attention mass the question-and-answer queries of the head's GQA group pay it.
3. **Curves.** Each head's entries are ordered by score; the cumulative utility of its top-b entries is relaxed to
   its least concave majorant (per-unit marginal utilities made non-increasing by pooling adjacent violators); all
   heads' marginal utilities are ranked together and, for each ratio ``r`` of the grid, the first
   ``round((1 − r)·layers·heads·T)`` are taken: a head's count among them is its budget. Keep fractions
   (budget / T) are averaged over prompts.

Departures from the paper (whose code uses its own datasets and long generations): the future is the task's
question and answer (tens of tokens) rather than a long continuation, and the calibration prompts are kvtrim's
synthetic tasks at a seed disjoint from evaluation's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.lukv import LUKV_KIND
from kvtrim.artifacts.store import model_display_name, save_artifact
from kvtrim.cache.sdpa import sdpa
from kvtrim.errors import InvalidParameterError

from .qfilter import DEFAULT_TASKS, calibration_prompts

__all__ = ["LUKVCalibration", "calibrate_lukv", "concave_gains", "greedy_head_budgets"]

_PROBE = "kvtrim_lukv_probe"


@dataclass(frozen=True)
class LUKVCalibration:
    """Settings of :func:`calibrate_lukv` (recorded in the artifact).

    Attributes:
        tasks: kvtrim task names whose prompts are the calibration text
        samples: prompts per task
        length: prompt length in tokens
        seed: task seed (evaluation uses 42)
        ratios: the compression ratios of the curve (fraction of entries removed), increasing in (0, 1)
        sink, window, eps: the ``lukv`` method's scorer and protected windows the curves are computed for
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    samples: int = 2
    length: int = 1024
    seed: int = 1234
    ratios: tuple[float, ...] = field(default_factory=lambda: tuple(round(i / 100, 2) for i in range(1, 100)))
    sink: int = 4
    window: int = 1
    eps: float = 0.02

    def __post_init__(self) -> None:
        for name in ("samples", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not self.tasks:
            raise InvalidParameterError("tasks must name at least one kvtrim task")
        r = list(self.ratios)
        if not r or any(not 0 < x < 1 for x in r) or any(b <= a for a, b in pairwise(r)):
            raise InvalidParameterError(f"ratios must increase strictly inside (0, 1), got {self.ratios!r}")


def concave_gains(gains: torch.Tensor) -> torch.Tensor:
    """Per-unit slopes ``[n]`` of the least concave majorant of ``cumsum(gains)`` (``gains`` ``[n]``, in keep
    order): adjacent violators of a non-increasing sequence are pooled into their mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for g in gains.double().tolist():
        blocks.append([g, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] <= blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out = [s / c for s, c in blocks for _ in range(int(c))]
    return torch.tensor(out, dtype=torch.float64)


def greedy_head_budgets(
    scores: torch.Tensor, utility: torch.Tensor, totals: list[int], sink: int = 0, window: int = 0
) -> torch.Tensor:
    """LU-KV's greedy allocation on one prompt.

    Args:
        scores: ``[heads, T]`` the scorer's scores (higher = kept first within a head)
        utility: ``[heads, T]`` each entry's future utility
        totals: entries kept over all heads, one allocation per total
        sink, window: the first ``sink`` and last ``window`` entries of every head are kept before the others
    Returns:
        ``[len(totals), heads]`` entries per head (each allocation sums to its total, clamped to ``[0, heads·T]``)
    """
    n, t = scores.shape
    protected = torch.zeros(t, dtype=torch.bool)
    protected[: min(sink, t)] = True
    if window > 0:
        protected[max(0, t - window) :] = True
    key = scores.double().masked_fill(protected, float("inf"))
    order = torch.argsort(key, dim=-1, descending=True, stable=True)
    gains = utility.double().gather(-1, order)
    p = int(protected.sum())
    slopes = torch.full((n, t), float("inf"), dtype=torch.float64)
    for h in range(n):
        if p < t:
            slopes[h, p:] = concave_gains(gains[h, p:])
    ranked = torch.argsort(slopes.flatten(), descending=True, stable=True) // t  # head of each ranked unit
    out = torch.stack([torch.bincount(ranked[: max(0, min(k, n * t))], minlength=n) for k in totals])
    return out


def _probe(utility: dict[int, torch.Tensor], context: list[int]):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scale = module.head_dim**-0.5 if scaling is None else scaling
        b, hq, n, _ = query.shape
        hkv = key.shape[1]
        out = sdpa(query, key, value, is_causal=True, scale=scale, enable_gqa=hq > hkv)
        t = context[0]
        keys = key.repeat_interleave(hq // hkv, dim=1).float()
        logits = query[:, :, t:].float() @ keys.transpose(-1, -2) * scale  # [b, hq, F, n]
        qpos = torch.arange(t, n, device=query.device)
        logits = logits.masked_fill(torch.arange(n, device=query.device)[None, :] > qpos[:, None], float("-inf"))
        probs = logits.softmax(-1)[..., :t].sum(2)  # [b, hq, T]
        utility[module.layer_idx] = probs.view(b, hkv, hq // hkv, t).sum(2)[0]
        return out.transpose(1, 2), None

    return attention


def _scores(model: torch.nn.Module, pipeline: Any, context_ids: torch.Tensor) -> torch.Tensor:
    """``[layers, kv_heads, T]`` the pipeline scorer's scores of the prefilled context."""
    from kvtrim.compression.compressor import BudgetSpec, layer_views
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache

    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, BudgetSpec(ratio=0.5), auto_compress=False)
    with kvtrim_attention_enabled(model), torch.inference_mode():
        model(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = context_ids.shape[1]
        views = layer_views(cache, torch.tensor([t], device=context_ids.device), pipeline.observation.accumulate)
        pipeline.scorer.prepare(views)
        return torch.stack([pipeline.scorer.score(v)[0].float().cpu() for v in views])


def calibrate_lukv(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: LUKVCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Compute the LU-KV budget curves on the calibration prompts and save the ``lukv`` artifact (``ratios``
    ``[R]``, ``keep_fractions`` ``[R, layers, kv_heads]``, ``per_prompt`` ``[prompts, R, layers, kv_heads]``, and
    ``mean_keep_fraction`` ``[layers, kv_heads]`` over the grid); returns its path."""
    from transformers import AttentionInterface

    from kvtrim.methods import get_method

    settings = settings or LUKVCalibration()
    start = time.perf_counter()
    pipeline = get_method("lukv", sink=settings.sink, window=settings.window, eps=settings.eps)
    prompts = calibration_prompts(tokenizer, settings.tasks, settings.samples, settings.length, settings.seed)
    device = next(model.parameters()).device
    per_prompt = []
    utility: dict[int, torch.Tensor] = {}
    context_length = [0]
    AttentionInterface.register(_PROBE, _probe(utility, context_length))
    for i, (context, future) in enumerate(prompts):
        t = context.shape[1]
        scores = _scores(model, pipeline, context.to(device))  # [L, H, T]
        previous = model.config._attn_implementation
        model.set_attn_implementation(_PROBE)
        try:
            utility.clear()
            context_length[0] = t
            with torch.inference_mode():
                model(input_ids=torch.cat([context, future], dim=1).to(device), use_cache=False, logits_to_keep=1)
        finally:
            model.set_attn_implementation(previous)
        oracle = torch.stack([utility[layer].float().cpu() for layer in sorted(utility)])  # [L, H, T]
        layers, heads = oracle.shape[:2]
        totals = [round((1 - r) * layers * heads * t) for r in settings.ratios]
        counts = greedy_head_budgets(
            scores.flatten(0, 1), oracle.flatten(0, 1), totals, settings.sink, settings.window
        )
        per_prompt.append((counts.double() / t).view(len(totals), layers, heads))
        if progress:
            print(f"lukv calibration: prompt {i + 1}/{len(prompts)} ({t} + {future.shape[1]} tokens)", flush=True)
    stacked = torch.stack(per_prompt)  # [P, R, L, H]
    keep = stacked.mean(0)
    meta = {
        "settings": {**asdict(settings), "scorer": f"expected_attention(eps={settings.eps}, n_sink={settings.sink})"},
        "summary": {
            "prompts": len(prompts),
            "context_tokens": [int(c.shape[1]) for c, _ in prompts],
            "future_tokens": [int(f.shape[1]) for _, f in prompts],
        },
        "seconds": time.perf_counter() - start,
        "primary_tensor": "mean_keep_fraction",
        "method": "greedy marginal future utility over each head's concave hull (kvtrim.calibration.lukv)",
        "model_name": model_display_name(model),
    }
    tensors = {
        "ratios": torch.tensor(settings.ratios, dtype=torch.float64),
        "keep_fractions": keep.float().contiguous(),
        "per_prompt": stacked.float().contiguous(),
        "mean_keep_fraction": keep.mean(0).float().contiguous(),
    }
    return save_artifact(LUKV_KIND, model, tensors, meta, out_dir)
