"""DuoAttention head gates (the ``duo`` artifact), calibrated by a cheap proxy that fits a CPU.

DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819) learns one gate ``α ∈ [0, 1]`` per (layer, KV head) by
gradient descent: attention becomes ``α·full + (1 − α)·streaming``, the loss is the distance between the gated
model's and the original model's hidden states on synthetic multi-passkey prompts plus an L1 penalty on ``α``
(2000 steps on 1k–32k-token prompts in the released config).

**kvtrim's procedure (a documented departure).** For every (layer, KV head), on a few synthetic passkey prompts
(kvtrim's ``passkey`` task, teacher-forced with the gold answer), measure how much the layer's attention output
would change if that head alone were streaming: for the last ``answer_window`` positions,

    dev[l, h] = mean_t ‖ Σ_{g ∈ group(h)} (o_full[g, t] − o_stream[g, t]) · W_Oᵀ[g] ‖₂ / ‖ o_full[:, t] · W_Oᵀ ‖₂

where ``o_stream`` attends only to the first ``sink`` and the last ``recent`` tokens of each query. It needs
one forward pass per prompt (no backward), measures each head against the original residual stream (the
paper's distillation measures all gated heads jointly at the model output), and uses passkey prompts of about
``length`` tokens in kvtrim's jargon haystack (the paper: BookSum text, 10 passkeys of 32 tokens). The gates
are ``α = dev / max(dev)``; only their order matters to ``duo_attention``, which streams the lowest-gate heads.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.store import model_display_name, save_artifact
from kvtrim.budgets.duo_heads import DUO_KIND
from kvtrim.cache.sdpa import sdpa
from kvtrim.errors import InvalidParameterError

__all__ = ["DuoCalibration", "calibrate_duo", "streaming_deviation"]

_PROBE = "kvtrim_duo_probe"


@dataclass(frozen=True)
class DuoCalibration:
    """Settings of :func:`calibrate_duo` (recorded in the artifact).

    Attributes:
        samples: passkey prompts
        length: prompt length in tokens (kvtrim's ``passkey`` task)
        sink, recent: the streaming window the deviation is measured against (``duo_attention``'s defaults)
        answer_window: last positions (the question, answer prefix and teacher-forced answer) averaged over
        seed: task seed (evaluation uses 42)
    """

    samples: int = 8
    length: int = 1024
    sink: int = 16
    recent: int = 48
    answer_window: int = 32
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("samples", "length", "answer_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParameterError(f"{name} must be a non-negative integer, got {value!r}")
        if self.sink + self.recent <= 0:
            raise InvalidParameterError("sink + recent must be positive")


def streaming_deviation(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    o_proj_weight: torch.Tensor,
    scaling: float,
    sink: int,
    recent: int,
    last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention, and per KV head the relative change of the layer's attention output (after
    ``o_proj``) when that head alone streams, for the last ``last`` queries.

    Args:
        query: ``[batch, q_heads, n, d]``; key, value: ``[batch, kv_heads, n, d]`` (no padding, positions 0..n-1)
        o_proj_weight: ``[hidden, q_heads * d]``
    Returns:
        ``(output [batch, n, q_heads, d], deviation [batch, kv_heads])``
    """
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    full = sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1)
    m = min(last, n)
    qpos = torch.arange(n - m, n, device=query.device)
    kpos = torch.arange(n, device=query.device)
    visible = (kpos[None, :] <= qpos[:, None]) & ((kpos[None, :] < sink) | (kpos[None, :] > qpos[:, None] - recent))
    stream = sdpa(
        query[:, :, -m:], key, value, attn_mask=visible, scale=scaling, enable_gqa=group > 1
    )
    w = o_proj_weight.view(o_proj_weight.shape[0], hq, d).to(query.dtype)  # [hidden, hq, d]
    delta = torch.einsum("bhtd,ohd->bhto", (full[:, :, -m:] - stream).float(), w.float())  # [b, hq, m, hidden]
    delta = delta.view(b, hkv, group, m, -1).sum(2).norm(dim=-1)  # [b, hkv, m]
    reference = torch.einsum("bhtd,ohd->bto", full[:, :, -m:].float(), w.float()).norm(dim=-1)  # [b, m]
    deviation = (delta / reference.clamp(min=1e-12)[:, None, :]).mean(-1)
    return full.transpose(1, 2), deviation


def _probe(store: dict[int, list[torch.Tensor]], settings: DuoCalibration):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scale = module.head_dim**-0.5 if scaling is None else scaling
        out, dev = streaming_deviation(
            query, key, value, module.o_proj.weight, scale, settings.sink, settings.recent, settings.answer_window
        )
        store.setdefault(module.layer_idx, []).append(dev)
        return out, None

    return attention


def _prompts(tokenizer: Any, settings: DuoCalibration) -> list[torch.Tensor]:
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template

    template = prompt_template(tokenizer)
    special = template.prefix == ""
    samples = generate_task("passkey", tokenizer, settings.length, settings.samples, seed=settings.seed)
    out = []
    for s in samples:
        text = template.context_part(s.context) + template.question_part(s.question, s.answer_prefix)
        text += (" " if s.answer_prefix and not s.answer_prefix.endswith(" ") else "") + s.answers[0]
        out.append(tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"])
    return out


def calibrate_duo(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: DuoCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Measure every (layer, KV head)'s streaming deviation on passkey prompts and save the ``duo`` artifact
    (tensors ``gates`` and ``deviation`` ``[layers, kv_heads]``, ``per_sample_deviation`` ``[samples, layers,
    kv_heads]``); returns the ``.safetensors`` path."""
    from transformers import AttentionInterface

    settings = settings or DuoCalibration()
    start = time.perf_counter()
    prompts = _prompts(tokenizer, settings)
    per_sample = []
    collected: dict[int, list[torch.Tensor]] = {}
    AttentionInterface.register(_PROBE, _probe(collected, settings))
    previous = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    try:
        device = next(model.parameters()).device
        for i, ids in enumerate(prompts):
            collected.clear()
            with torch.inference_mode():
                model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
            per_sample.append(torch.stack([collected[layer][0][0] for layer in sorted(collected)]).cpu())
            if progress:
                print(f"duo calibration: prompt {i + 1}/{len(prompts)} ({ids.shape[1]} tokens)", flush=True)
    finally:
        model.set_attn_implementation(previous)
    stacked = torch.stack(per_sample)  # [samples, layers, kv_heads]
    deviation = stacked.mean(0)
    gates = deviation / deviation.max().clamp(min=1e-12)
    order = torch.sort(gates.flatten(), descending=True).indices[:8]
    heads = gates.shape[1]
    summary = {
        "prompts": len(prompts),
        "prompt_tokens": [int(p.shape[1]) for p in prompts],
        "retrieval_heads_at_0.5": int((gates >= 0.5).sum()),
        "top_heads": [f"{int(i) // heads}.{int(i) % heads}" for i in order],
    }
    meta = {
        "settings": asdict(settings),
        "summary": summary,
        "seconds": time.perf_counter() - start,
        "primary_tensor": "gates",
        "method": "streaming-deviation proxy of DuoAttention's gate optimisation (see kvtrim.calibration.duo)",
        "model_name": model_display_name(model),
    }
    tensors = {"gates": gates, "deviation": deviation, "per_sample_deviation": stacked}
    return save_artifact(DUO_KIND, model, tensors, meta, out_dir)
