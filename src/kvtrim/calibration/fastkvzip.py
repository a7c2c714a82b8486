"""Fast KVzip's gates (the ``fastkvzip`` artifact): per layer, a small attention-like gate trained to predict
KVzip's score of every token and KV head from the hidden state entering attention.

Fast KVzip (Kim, Han & Yun, arXiv 2601.17668) distils KVzip's scores into a gate per layer
(:func:`~kvtrim.scoring.surrogate.gate_scores`): one gate key and ``G`` gate queries (one per query head of the KV
head's group) of width 16, RMS-normalised, whose logit competes with 16 learned sink keys; the output is in (0, 1),
as KVzip's scores, and the training loss is the binary cross-entropy between the two. kvtrim's procedure, and
where it departs (docs/calibration.md):

* **Targets.** kvtrim's own ``kvzip`` scores, shared with KVzap's calibration
  (:mod:`kvtrim.calibration.kvzip_targets`, the same prompts and tokens; collected once and cached); the authors
  extract KVzip scores from their own corpus with their code.
* **Architecture.** As the paper's (width 16, 16 sink keys, ``G`` = query heads per KV head, sink keys and the
  logit bias start at zero, the RMS norms' weights at one).
* **Optimisation.** AdamW, lr 1e-2 with cosine decay, batch 512, a few epochs over a few thousand tokens (the
  authors: SGD with momentum 0.9, lr 0.2, 5,000 steps of 1,000 tokens on a GPU). The loss is the binary
  cross-entropy averaged over tokens and summed over heads and layers, as theirs.
* **Fit report.** As KVzap's: Spearman correlation and kept-set overlaps on the held-out prompts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.store import save_artifact
from kvtrim.artifacts.surrogates import FASTKVZIP_KIND
from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.surrogate import gate_scores

from .kvzip_targets import TargetSettings, collect_targets, surrogate_fit

__all__ = ["FastKVzipCalibration", "calibrate_fastkvzip", "fit_gate", "init_gate"]


@dataclass(frozen=True)
class FastKVzipCalibration:
    """Settings of :func:`calibrate_fastkvzip` (recorded in the artifact).

    Attributes:
        targets: calibration prompts and tokens (shared with KVzap's calibration)
        width: the gate queries' and keys' width ``d``
        sinks: learned sink keys per KV head
        epochs, lr, batch_size: the training
        keep_fraction: the kept share the held-out overlap is measured at (0.125: ratio 0.875)
    """

    targets: TargetSettings = field(default_factory=TargetSettings)
    width: int = 16
    sinks: int = 16
    epochs: int = 10
    lr: float = 1e-2
    batch_size: int = 512
    keep_fraction: float = 0.125

    def __post_init__(self) -> None:
        for name in ("width", "sinks", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise InvalidParameterError(f"lr must be > 0, got {self.lr!r}")
        if not (isinstance(self.keep_fraction, (int, float)) and 0 < self.keep_fraction < 1):
            raise InvalidParameterError(f"keep_fraction must be in (0, 1), got {self.keep_fraction!r}")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["targets"] = self.targets.as_dict()
        return out


def init_gate(
    layers: int, heads: int, groups: int, hidden: int, width: int, sinks: int, gen: torch.Generator
) -> dict[str, torch.nn.Parameter]:
    """Fresh gate parameters (:mod:`kvtrim.artifacts.surrogates` layout): projections uniform in ``±1/√hidden``,
    projection bias, logit bias and sink keys zero, norm weights one."""
    bound = 1 / math.sqrt(hidden)

    def uniform(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter((torch.rand(*shape, generator=gen) * 2 - 1) * bound)

    return {
        "gate_q_weight": uniform(layers, heads * groups * width, hidden),
        "gate_q_bias": torch.nn.Parameter(torch.zeros(layers, heads * groups * width)),
        "gate_k_weight": uniform(layers, heads * width, hidden),
        "gate_q_norm": torch.nn.Parameter(torch.ones(layers, width)),
        "gate_k_norm": torch.nn.Parameter(torch.ones(layers, width)),
        "gate_bias": torch.nn.Parameter(torch.zeros(layers, heads, groups)),
        "gate_sink_keys": torch.nn.Parameter(torch.zeros(layers, heads, sinks, width)),
    }


def fit_gate(
    x: torch.Tensor, y: torch.Tensor, groups: int, settings: FastKVzipCalibration, seed: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train every layer's gate on ``x`` ``[n, layers, hidden]`` → KVzip scores ``y`` ``[n, layers, kv_heads]``
    (binary cross-entropy); returns the tensors and the mean training loss of every epoch."""
    gen = torch.Generator().manual_seed(seed)
    n, layers, hidden = x.shape
    params = init_gate(layers, y.shape[-1], groups, hidden, settings.width, settings.sinks, gen)
    opt = torch.optim.AdamW(list(params.values()), lr=settings.lr)
    steps = settings.epochs * math.ceil(n / settings.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    target = y.float().clamp(0.0, 1.0)
    losses = []
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, settings.batch_size):
            idx = order[start : start + settings.batch_size]
            xb = x[idx].float()
            loss = x.new_zeros((), dtype=torch.float32)
            for layer in range(layers):
                pred = gate_scores(params, layer, xb[:, layer][None])[0].clamp(1e-6, 1 - 1e-6)  # [kv, b]
                bce = torch.nn.functional.binary_cross_entropy(pred, target[idx, layer].T, reduction="none")
                loss = loss + bce.mean(-1).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    return {name: p.detach().contiguous() for name, p in params.items()}, losses


def gate_scores_of(tensors: dict[str, torch.Tensor]):
    """``predict(layer, hidden) -> [batch, kv_heads, q]`` of the gates ``tensors``."""
    return lambda layer, hidden: gate_scores(tensors, layer, hidden)


def calibrate_fastkvzip(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: FastKVzipCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
    targets_cache: str | Path | None = None,
) -> Path:
    """Collect KVzip targets (or read them from ``targets_cache``, shared with ``kvtrim calibrate kvzap``), train
    the gates, measure them on the held-out prompts and save the ``fastkvzip`` artifact; returns its path."""
    settings = settings or FastKVzipCalibration()
    target = settings.targets
    start = time.perf_counter()
    data = collect_targets(model, tokenizer, target, targets_cache, progress)
    cfg = model.config
    groups = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    fit_start = time.perf_counter()
    tensors, losses = fit_gate(data.x, data.y, groups, settings, target.seed)
    tensors = {name: t.half().float() for name, t in tensors.items()}  # what the float16 artifact will hold
    fit_s = time.perf_counter() - fit_start
    summary: dict[str, Any] = {"training_tokens": int(data.x.shape[0]), "prompts": data.sources}
    if data.heldout:
        gate = gate_scores_of(tensors)
        fit = surrogate_fit(gate, data.heldout, target.n_sink, settings.keep_fraction)
        tensors["heldout_spearman_gate"] = fit.pop("spearman_per_head")
        summary["heldout_gate"] = {k: round(v, 4) for k, v in fit.items()}
    summary["epoch_losses"] = [round(v, 4) for v in losses]
    summary["collect_seconds"] = round(data.seconds, 1)
    summary["targets_cached"] = data.cached
    summary["fit_seconds"] = round(fit_s, 1)
    tensors = {name: t.half() if name.startswith("gate_") else t for name, t in tensors.items()}
    meta = {
        "settings": settings.as_dict(),
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "primary_tensor": "heldout_spearman_gate" if data.heldout else None,
        "threads": torch.get_num_threads(),
    }
    return save_artifact(FASTKVZIP_KIND, model, tensors, meta, out_dir)
