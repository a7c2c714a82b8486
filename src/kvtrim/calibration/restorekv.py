"""RestoreKV's restore tokens (the ``restorekv`` artifact): restore embeddings and an attention LoRA trained by
self-distillation from the full-cache model.

RestoreKV (arXiv 2608.01247; kvpress RestoreKVPress) trains only ``K`` restore-token embeddings and a LoRA of the
model, keeping every model weight frozen: the student is the model reading a KVzip-compressed cache to which the
restore tokens' entries (encoded by one LoRA-adapted pass over the full cache) were appended; the teacher is the
same model reading the full cache; the loss is the KL divergence between the teacher's and the student's
next-token distributions on the tokens that follow the context. kvtrim's procedure (:func:`calibrate_restorekv`)
and where it departs from the paper's recipe (docs/calibration.md):

* **Scale.** Minutes on a CPU: a few dozen prompts of a few hundred tokens (the context) followed by a short
  continuation the KL is measured on, one prompt per step, a few hundred steps; the authors train on long
  contexts on GPUs, for 8B models.
* **Text.** kvtrim's calibration prompts (CPython's bundled pydoc prose and synthetic tasks, alternating, as
  KVzap's and Fast KVzip's calibrations); each prompt's last ``continuation`` tokens are the continuation.
* **Adapter.** Hand-written rank-``rank`` LoRA on the attention projections q, k, v and o of every layer
  (``B`` starts at zero, ``A`` Gaussian with variance ``1/in``; no scaling factor, it is folded into ``B``);
  kvpress loads the authors' PEFT adapters, whose targets and rank are theirs.
* **Positions.** The restore tokens enter at the last context position (:class:`~kvtrim.selection.restore_tokens.
  RestoreTokens`), the continuation keeps its positions; in the paper they follow the context.
* **Ratios.** Each step draws its compression ratio from ``ratios`` in turn, so one artifact serves them.
* **Optimiser.** Adam, cosine-decayed learning rate, gradient norm clipped at 1.
* **Fit report.** The mean held-out KL at each ratio with the trained restore tokens and with plain KVzip at the
  same budget (no restore tokens), recorded in the artifact's metadata.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.restorekv import LORA_TARGETS, RESTOREKV_KIND, RestoreWeights
from kvtrim.artifacts.store import save_artifact
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import Prefill
from kvtrim.selection.restore_tokens import RestoreTokens

from .kvzip_targets import SYNTHETIC_TASKS, TargetSettings, calibration_prompts

__all__ = ["RestoreKVCalibration", "calibrate_restorekv", "distillation_kl", "init_restore"]


@dataclass(frozen=True)
class RestoreKVCalibration:
    """Settings of :func:`calibrate_restorekv` (recorded in the artifact).

    Attributes:
        prompts, heldout: training and held-out prompts
        length: context tokens of a prompt (its continuation follows)
        continuation: tokens after the context the KL is measured on
        tokens: restore tokens ``K`` (8: the authors')
        rank: the adapter's rank
        targets: adapted projections (of ``q``, ``k``, ``v``, ``o``)
        ratios: compression ratios the steps cycle through
        steps, lr: the training
        seed: prompt choice, synthetic task samples and the initialisation
        tasks, pydoc: the calibration text (as :class:`~kvtrim.calibration.kvzip_targets.TargetSettings`)
    """

    prompts: int = 24
    heldout: int = 4
    length: int = 320
    continuation: int = 32
    tokens: int = 8
    rank: int = 8
    targets: tuple[str, ...] = LORA_TARGETS
    ratios: tuple[float, ...] = (0.75, 0.875)
    steps: int = 120
    lr: float = 5e-3
    seed: int = 1234
    tasks: tuple[str, ...] = SYNTHETIC_TASKS
    pydoc: bool = True

    def __post_init__(self) -> None:
        for name, low in (("prompts", 1), ("heldout", 0), ("length", 32), ("continuation", 1), ("tokens", 1),
                          ("rank", 1), ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.targets or any(t not in LORA_TARGETS for t in self.targets):
            raise InvalidParameterError(f"targets must be a non-empty subset of {LORA_TARGETS}, got {self.targets!r}")
        if not self.ratios or any(not isinstance(r, (int, float)) or not 0 < r < 1 for r in self.ratios):
            raise InvalidParameterError(f"ratios must be numbers in (0, 1), got {self.ratios!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise InvalidParameterError(f"lr must be > 0, got {self.lr!r}")
        if not self.tasks and not self.pydoc:
            raise InvalidParameterError("tasks is empty and pydoc is False: no calibration text left")

    def as_dict(self) -> dict:
        return asdict(self)


def init_restore(model: torch.nn.Module, settings: RestoreKVCalibration, gen: torch.Generator) -> RestoreWeights:
    """Fresh trainable weights: the embeddings of ``tokens`` random vocabulary entries; each adapter ``A``
    Gaussian with variance ``1/in``, ``B`` zero (the adapter starts as no change)."""
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    rows = torch.randint(0, embed.shape[0], (settings.tokens,), generator=gen)
    layers = model.config.num_hidden_layers
    lora = {}
    for target in settings.targets:
        proj = getattr(_attention(model, 0), f"{target}_proj")
        out_f, in_f = proj.weight.shape
        a = torch.randn(layers, settings.rank, in_f, generator=gen) / math.sqrt(in_f)
        lora[target] = (a.requires_grad_(), torch.zeros(layers, out_f, settings.rank, requires_grad=True))
    return RestoreWeights(embed[rows].clone().requires_grad_(), lora)


def _attention(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].self_attn


def distillation_kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student); ``teacher_logp`` ``[n, vocab]`` log-probabilities,
    ``student_logits`` ``[n, vocab]``."""
    student_logp = torch.log_softmax(student_logits.float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()


@dataclass
class _Prompt:
    prefill: Prefill
    continuation: torch.Tensor  # [1, c]
    teacher: torch.Tensor  # [c, vocab] log-probabilities of the full-cache model
    source: str


def _continuation_logits(model, cache, prefill: Prefill, ids: torch.Tensor) -> torch.Tensor:
    """``[c, vocab]`` logits of the continuation ``ids`` ``[1, c]`` fed after ``cache``."""
    n, c = prefill.mask.shape[1], ids.shape[1]
    device = prefill.mask.device
    mask = torch.cat([prefill.mask, torch.ones(1, c, dtype=prefill.mask.dtype, device=device)], dim=1)
    positions = torch.arange(n, n + c, device=device).view(1, c)
    out = model(
        input_ids=ids.to(device), attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    )
    return out.logits[0]


def _prepare(model, pipeline, prompts: list[tuple[str, torch.Tensor]], continuation: int) -> list[_Prompt]:
    out = []
    device = model.get_input_embeddings().weight.device
    for source, ids in prompts:
        ids = ids.to(device)
        context, cont = ids[:, :-continuation], ids[:, -continuation:]
        with torch.no_grad():
            prefill = Prefill.plain(model, context, torch.ones_like(context), pipeline.observation)
            full = prefill.compressed(None, None).cache
            teacher = torch.log_softmax(_continuation_logits(model, full, prefill, cont).float(), dim=-1)
        out.append(_Prompt(prefill, cont, teacher, source))
    return out


def _student_kl(model, pipeline, prompt: _Prompt, ratio: float) -> torch.Tensor:
    compressed = prompt.prefill.compressed(pipeline, BudgetSpec(ratio=ratio)).cache
    logits = _continuation_logits(model, compressed, prompt.prefill, prompt.continuation)
    return distillation_kl(prompt.teacher, logits)


def calibrate_restorekv(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: RestoreKVCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Train the restore embeddings and the adapter on ``model`` (weights frozen), measure the held-out KL against
    plain KVzip and save the ``restorekv`` artifact; returns its path."""
    settings = settings or RestoreKVCalibration()
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(settings.seed)
    text = TargetSettings(
        prompts=settings.prompts,
        heldout=settings.heldout,
        length=settings.length + settings.continuation,
        tokens_per_prompt=1,
        n_sink=4,
        seed=settings.seed,
        tasks=settings.tasks,
        pydoc=settings.pydoc,
    )
    all_prompts = calibration_prompts(tokenizer, settings.prompts + settings.heldout, text)
    short = [s for s, ids in all_prompts if ids.shape[1] <= settings.continuation + 8]
    if short:
        raise InvalidParameterError(f"prompts {short} are too short for a continuation of {settings.continuation}")
    weights = init_restore(model, settings, gen)
    restore = RestoreTokens(weights=weights, train=True)
    pipeline = get_method("restorekv")
    pipeline.append = restore
    baseline = get_method("kvzip")
    was_training = model.training
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in frozen:
        p.requires_grad_(False)
    params = [weights.embeddings, *(t for pair in weights.lora.values() for t in pair)]
    optimiser = torch.optim.Adam(params, lr=settings.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=settings.steps)
    losses: list[float] = []
    try:
        with kvtrim_attention_enabled(model):
            pipeline.bind(model)
            baseline.bind(model)
            train = _prepare(model, pipeline, all_prompts[: settings.prompts], settings.continuation)
            heldout = _prepare(model, pipeline, all_prompts[settings.prompts :], settings.continuation)
            prepared_s = time.perf_counter() - start
            for step in range(settings.steps):
                prompt = train[step % len(train)]
                ratio = settings.ratios[(step + step // len(train)) % len(settings.ratios)]  # every pair, in turn
                optimiser.zero_grad()
                loss = _student_kl(model, pipeline, prompt, ratio)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimiser.step()
                schedule.step()
                losses.append(float(loss.detach()))
                if progress and (step + 1) % max(1, settings.steps // 10) == 0:
                    recent = losses[-max(1, settings.steps // 10) :]
                    print(f"step {step + 1}/{settings.steps}: KL {sum(recent) / len(recent):.4f}", flush=True)
            restore.train = False
            fit = {}
            with torch.no_grad():
                for ratio in settings.ratios:
                    ours = [float(_student_kl(model, pipeline, p, ratio)) for p in heldout]
                    plain = [float(_student_kl(model, baseline, p, ratio)) for p in heldout]
                    if ours:
                        fit[str(ratio)] = {
                            "restorekv_kl": round(sum(ours) / len(ours), 4),
                            "kvzip_kl": round(sum(plain) / len(plain), 4),
                        }
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    tensors = {name: t.detach().half() for name, t in weights.tensors().items()}
    window = max(1, settings.steps // 10)
    summary = {
        "prompts": [s for s, _ in all_prompts[: settings.prompts]],
        "heldout_prompts": [s for s, _ in all_prompts[settings.prompts :]],
        "first_steps_kl": round(sum(losses[:window]) / window, 4),
        "last_steps_kl": round(sum(losses[-window:]) / window, 4),
        "heldout_kl": fit,
        "prepare_seconds": round(prepared_s, 1),
    }
    meta = {
        "settings": settings.as_dict(),
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "threads": torch.get_num_threads(),
    }
    return save_artifact(RESTOREKV_KIND, model, tensors, meta, out_dir)
