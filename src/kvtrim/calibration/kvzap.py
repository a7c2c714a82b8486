"""KVzap's surrogate (the ``kvzap`` artifact): per layer, a linear map and a 2-layer MLP from the hidden state
entering attention to KVzip's log-score of each KV head.

KVzap (Jegou & Jeblick, arXiv 2601.07891) trains, for every layer, a linear model (ridge regression) and an MLP
(one hidden layer, GELU) on ``(hidden state, log score)`` pairs of tokens drawn from 750–1,250-token pretraining
texts, the scores being KVzip+ scores of the text re-read after a repeat instruction. kvtrim's procedure, and where
it departs (docs/calibration.md):

* **Targets.** kvtrim's own ``kvzip`` scores (:mod:`kvtrim.calibration.kvzip_targets`): the largest attention the
  reconstruction pays each entry, max over the KV head's group, in log. The paper's KVzip+ also divides each
  attention weight by the norm of the reconstruction query's hidden state and multiplies it by ``‖W_O v‖``; kvtrim
  trains on the scores its ``kvzip`` method ranks by, so ``kvzap`` is a surrogate of that method.
* **Data.** A few dozen calibration prompts (pydoc prose and kvtrim's synthetic tasks, seed 1234) instead of
  thousands of Nemotron pretraining samples; ``tokens_per_prompt`` random tokens of each (the first ``n_sink``
  left out: KVzip pins them).
* **Linear.** Closed-form ridge regression per layer (λ = 1, intercept unpenalised), as the reference's default.
* **MLP.** Hidden width 64 (the reference: 512), AdamW, lr 5e-3 with cosine decay, gradient-norm clipping 1.0,
  batch 512, MSE, all layers trained together; 10 epochs (the reference: 15), to fit a CPU.
* **Storage.** The surrogates' weights are saved in float16 (the artifact ships inside the package) and used in
  float32.
* **Fit report.** On held-out prompts (all their tokens): Spearman correlation between predicted and true scores
  per (layer, KV head), and the overlap of the kept sets at a keep fraction, per head and across the whole model.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.store import save_artifact
from kvtrim.artifacts.surrogates import KVZAP_KIND, SURROGATE_TENSORS
from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.surrogate import surrogate_predict

from .kvzip_targets import TargetSettings, collect_targets, log_scores, surrogate_fit

_SURROGATE = {name for names in SURROGATE_TENSORS.values() for name in names}

__all__ = ["KVzapCalibration", "calibrate_kvzap", "fit_mlp", "fit_ridge"]


@dataclass(frozen=True)
class KVzapCalibration:
    """Settings of :func:`calibrate_kvzap` (recorded in the artifact).

    Attributes:
        targets: calibration prompts and tokens (:class:`~kvtrim.calibration.kvzip_targets.TargetSettings`)
        ridge: the linear surrogate's L2 penalty
        hidden_dim, epochs, lr, batch_size: the MLP surrogate's width and training
        keep_fraction: the kept share the held-out overlap is measured at (0.125: ratio 0.875)
    """

    targets: TargetSettings = field(default_factory=TargetSettings)
    ridge: float = 1.0
    hidden_dim: int = 64
    epochs: int = 10
    lr: float = 5e-3
    batch_size: int = 512
    keep_fraction: float = 0.125

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.ridge, (int, float)) and self.ridge >= 0):
            raise InvalidParameterError(f"ridge must be >= 0, got {self.ridge!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise InvalidParameterError(f"lr must be > 0, got {self.lr!r}")
        if not (isinstance(self.keep_fraction, (int, float)) and 0 < self.keep_fraction < 1):
            raise InvalidParameterError(f"keep_fraction must be in (0, 1), got {self.keep_fraction!r}")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["targets"] = self.targets.as_dict()
        return out


def fit_ridge(x: torch.Tensor, y: torch.Tensor, penalty: float) -> dict[str, torch.Tensor]:
    """Per-layer ridge regression, intercept unpenalised.

    Args:
        x: ``[n, layers, hidden]``; y: ``[n, layers, kv_heads]``
    Returns:
        ``linear_weight`` ``[layers, kv_heads, hidden]`` and ``linear_bias`` ``[layers, kv_heads]``
    """
    x, y = x.double().transpose(0, 1), y.double().transpose(0, 1)  # [layers, n, ·]
    xm, ym = x.mean(1, keepdim=True), y.mean(1, keepdim=True)
    xc, yc = x - xm, y - ym
    gram = xc.transpose(1, 2) @ xc + penalty * torch.eye(x.shape[-1], dtype=x.dtype)
    weight = torch.linalg.solve(gram, xc.transpose(1, 2) @ yc)  # [layers, hidden, kv]
    bias = ym[:, 0] - (xm @ weight)[:, 0]
    return {"linear_weight": weight.transpose(1, 2).float().contiguous(), "linear_bias": bias.float().contiguous()}


def fit_mlp(x: torch.Tensor, y: torch.Tensor, settings: KVzapCalibration, seed: int) -> tuple[dict, list[float]]:
    """One MLP per layer (``GELU(x·W1ᵀ + b1)·W2ᵀ + b2``), all layers trained together on the MSE; returns the
    tensors (:mod:`kvtrim.artifacts.surrogates` layout) and the mean training loss of every epoch."""
    gen = torch.Generator().manual_seed(seed)
    n, layers, hidden = x.shape
    heads, width = y.shape[-1], settings.hidden_dim

    def init(rows: int, cols: int) -> torch.nn.Parameter:
        bound = 1 / math.sqrt(cols)
        return torch.nn.Parameter((torch.rand(layers, rows, cols, generator=gen) * 2 - 1) * bound)

    w1, w2 = init(width, hidden), init(heads, width)
    b1 = torch.nn.Parameter(torch.zeros(layers, width))
    b2 = torch.nn.Parameter(y.float().mean(0).clone())
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=settings.lr)
    steps = settings.epochs * math.ceil(n / settings.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    losses = []
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, settings.batch_size):
            idx = order[start : start + settings.batch_size]
            xb, yb = x[idx].float().transpose(0, 1), y[idx].float().transpose(0, 1)  # [layers, b, ·]
            inner = torch.nn.functional.gelu(torch.baddbmm(b1[:, None], xb, w1.transpose(1, 2)))
            pred = torch.baddbmm(b2[:, None], inner, w2.transpose(1, 2))
            loss = torch.nn.functional.mse_loss(pred, yb)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    tensors = {"mlp_w1": w1, "mlp_b1": b1, "mlp_w2": w2, "mlp_b2": b2}
    return {k: v.detach().contiguous() for k, v in tensors.items()}, losses


def calibrate_kvzap(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: KVzapCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
    targets_cache: str | Path | None = None,
) -> Path:
    """Collect KVzip targets on calibration prompts (or read them from ``targets_cache``, see
    :func:`~kvtrim.calibration.kvzip_targets.collect_targets`), fit both surrogates, measure them on the held-out
    prompts and save the ``kvzap`` artifact; returns the ``.safetensors`` path."""
    settings = settings or KVzapCalibration()
    target = settings.targets
    start = time.perf_counter()
    data = collect_targets(model, tokenizer, target, targets_cache, progress)
    x, y = data.x.float(), log_scores(data.y)
    fit_start = time.perf_counter()
    tensors = fit_ridge(x, y, settings.ridge)
    mlp, losses = fit_mlp(x, y, settings, target.seed)
    tensors.update(mlp)
    del x, y
    tensors = {name: t.half().float() for name, t in tensors.items()}  # what the float16 artifact will hold
    fit_s = time.perf_counter() - fit_start
    summary: dict[str, Any] = {"training_tokens": int(data.x.shape[0]), "prompts": data.sources}
    for kind in ("linear", "mlp"):
        if data.heldout:

            def predict(layer: int, hidden: torch.Tensor, kind: str = kind) -> torch.Tensor:
                return surrogate_predict(tensors, kind, layer, hidden)

            fit = surrogate_fit(predict, data.heldout, target.n_sink, settings.keep_fraction)
            tensors[f"heldout_spearman_{kind}"] = fit.pop("spearman_per_head")
            summary[f"heldout_{kind}"] = {k: round(v, 4) for k, v in fit.items()}
    summary["mlp_epoch_losses"] = [round(v, 4) for v in losses]
    summary["collect_seconds"] = round(data.seconds, 1)
    summary["targets_cached"] = data.cached
    summary["fit_seconds"] = round(fit_s, 1)
    tensors = {name: t.half() if name in _SURROGATE else t for name, t in tensors.items()}
    meta = {
        "settings": settings.as_dict(),
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "primary_tensor": "heldout_spearman_mlp" if data.heldout else None,
        "threads": torch.get_num_threads(),
    }
    return save_artifact(KVZAP_KIND, model, tensors, meta, out_dir)
