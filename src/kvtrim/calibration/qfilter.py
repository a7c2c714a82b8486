"""Q-Filters (the ``qfilter`` artifact): per (layer, KV head), the principal direction of the model's queries.

Q-Filters (Godey et al., arXiv 2503.02812) estimate, per head, the first right singular vector of the matrix of
queries seen on calibration text, oriented so that the queries' projections on it are mostly positive; at
compression a key's score is its projection on that direction (:class:`~kvtrim.scoring.query_filter.
QueryFilterScorer`).

kvtrim's procedure: the post-RoPE queries of every prompt position (the keys in the cache are post-RoPE too) are
read from inside the attention call; for each (layer, KV head) the queries of all the query heads of its GQA group
are stacked and their Gram matrix ``Σ q qᵀ`` accumulated (``[head_dim, head_dim]``: the right singular vectors of
the stacked queries are its eigenvectors, so no query matrix is kept); the filter is the top eigenvector, signed so
that ``Σ ⟨q, u⟩ > 0``. Calibration text: the prompts (context, question and answer) of kvtrim's synthetic tasks at
a seed disjoint from evaluation's. The paper computes one filter per query head on generic pre-training text
(kvpress's published filters are per KV head).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.qfilter import QFILTER_KIND
from kvtrim.artifacts.store import model_display_name, save_artifact
from kvtrim.cache.sdpa import sdpa
from kvtrim.errors import InvalidParameterError

__all__ = ["QFilterCalibration", "calibrate_qfilter", "filters_from_gram"]

_PROBE = "kvtrim_qfilter_probe"
DEFAULT_TASKS = ("passkey", "niah_single_2", "niah_multikey_1", "vt", "fwe")


@dataclass(frozen=True)
class QFilterCalibration:
    """Settings of :func:`calibrate_qfilter` (recorded in the artifact).

    Attributes:
        tasks: kvtrim task names whose prompts are the calibration text
        samples: prompts per task
        length: prompt length in tokens
        seed: task seed (evaluation uses 42)
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    samples: int = 2
    length: int = 1024
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("samples", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not self.tasks:
            raise InvalidParameterError("tasks must name at least one kvtrim task")


def filters_from_gram(gram: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit filters ``[..., d]`` (top eigenvectors of ``gram`` ``[..., d, d]``, signed so that ``⟨total, u⟩ ≥ 0``
    with ``total`` ``[..., d]`` the sum of the queries) and the share of ``Σ‖q‖²`` they explain ``[...]``."""
    values, vectors = torch.linalg.eigh(gram.double())
    u = vectors[..., -1]  # eigh sorts ascending
    sign = torch.where((u * total.double()).sum(-1) < 0, -1.0, 1.0)
    u = u * sign[..., None]
    explained = values[..., -1] / values.sum(-1).clamp(min=1e-30)
    return u.float(), explained.float()


def _probe(gram: dict[int, torch.Tensor], total: dict[int, torch.Tensor]):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scale = module.head_dim**-0.5 if scaling is None else scaling
        b, hq, n, d = query.shape
        hkv = key.shape[1]
        q = query.detach().double().view(b, hkv, hq // hkv, n, d).transpose(0, 1).reshape(hkv, -1, d)
        layer = module.layer_idx
        gram[layer] = gram.get(layer, 0) + q.transpose(1, 2) @ q
        total[layer] = total.get(layer, 0) + q.sum(1)
        out = sdpa(query, key, value, is_causal=True, scale=scale, enable_gqa=hq > hkv)
        return out.transpose(1, 2), None

    return attention


def calibration_prompts(tokenizer: Any, tasks: tuple[str, ...], samples: int, length: int, seed: int) -> list[Any]:
    """``(context_ids [1, T], future_ids [1, F])`` per sample: the task prompt's context part, and its question part
    followed by the first gold answer."""
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template

    template = prompt_template(tokenizer)
    special = template.prefix == ""
    out = []
    for task in tasks:
        for s in generate_task(task, tokenizer, length, samples, seed=seed):
            context = template.context_part(s.context)
            future = template.question_part(s.question, s.answer_prefix)
            future += (" " if s.answer_prefix and not s.answer_prefix.endswith(" ") else "") + s.answers[0]
            ids = tokenizer(context + future, return_tensors="pt", add_special_tokens=special)["input_ids"]
            n_ctx = tokenizer(context, return_tensors="pt", add_special_tokens=special)["input_ids"].shape[1]
            out.append((ids[:, :n_ctx], ids[:, n_ctx:]))
    return out


def calibrate_qfilter(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: QFilterCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Accumulate every layer's query Gram matrices on the calibration prompts and save the ``qfilter`` artifact
    (``filters`` ``[layers, kv_heads, head_dim]``, ``explained`` ``[layers, kv_heads]``); returns its path."""
    from transformers import AttentionInterface

    settings = settings or QFilterCalibration()
    start = time.perf_counter()
    prompts = calibration_prompts(tokenizer, settings.tasks, settings.samples, settings.length, settings.seed)
    gram: dict[int, torch.Tensor] = {}
    total: dict[int, torch.Tensor] = {}
    AttentionInterface.register(_PROBE, _probe(gram, total))
    previous = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    tokens = 0
    try:
        device = next(model.parameters()).device
        for i, (context, future) in enumerate(prompts):
            ids = torch.cat([context, future], dim=1).to(device)
            tokens += ids.shape[1]
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if progress:
                print(f"qfilter calibration: prompt {i + 1}/{len(prompts)} ({ids.shape[1]} tokens)", flush=True)
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(gram)
    filters, explained = filters_from_gram(
        torch.stack([gram[i] for i in layers]), torch.stack([total[i] for i in layers])
    )
    meta = {
        "settings": asdict(settings),
        "summary": {
            "prompts": len(prompts),
            "tokens": tokens,
            "mean_explained": float(explained.mean()),
            "min_explained": float(explained.min()),
        },
        "seconds": time.perf_counter() - start,
        "primary_tensor": "explained",
        "method": "top eigenvector of the Gram matrix of the post-RoPE queries of each GQA group (kvtrim.calibration."
        "qfilter)",
        "model_name": model_display_name(model),
    }
    tensors = {"filters": filters.contiguous(), "explained": explained.contiguous()}
    return save_artifact(QFILTER_KIND, model, tensors, meta, out_dir)

