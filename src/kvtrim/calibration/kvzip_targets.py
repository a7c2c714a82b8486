"""Training targets for learned surrogates of KVzip (KVzap, Fast KVzip): per (layer, token, KV head), the hidden
state entering the layer's attention and KVzip's score of the entry, on calibration prompts.

The scores are kvtrim's own ``kvzip`` scorer's (:class:`~kvtrim.scoring.reconstruction.ReconstructionScorer`): the
largest attention any reconstruction query of the KV head's group pays the entry when the model re-reads its
context after "Repeat the previous context exactly." So a surrogate trained on them predicts exactly what the
``kvzip`` method ranks by.

Calibration prompts alternate two sources, both available offline: windows of CPython's bundled language-reference
prose (``pydoc_data.topics``, as CompilerKV's calibration) and kvtrim's synthetic tasks (RULER-style haystacks
with needles, passkeys) drawn with a seed other than the evaluation's (42). Each prompt is the
chat template's context part only (no question), as the ``kvzip`` method compresses a context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtrim.errors import InvalidParameterError

__all__ = ["KVzipTargets", "TargetSettings", "calibration_prompts", "kvzip_targets", "log_scores"]

SYNTHETIC_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multivalue", "niah_single_3", "passkey")
"""Task families the synthetic half of the calibration prompts cycles through."""

SCORE_FLOOR = 1e-10
"""Scores are clamped at this before the log (a softmax probability that underflowed)."""


@dataclass(frozen=True)
class TargetSettings:
    """Which calibration prompts and which of their tokens (recorded in the artifact).

    Attributes:
        prompts: training prompts
        heldout: held-out prompts (the fit is measured on them)
        length: prompt length in tokens
        tokens_per_prompt: training tokens drawn at random from each prompt (all of them for held-out prompts)
        n_sink: first positions left out (KVzip pins them above every score)
        seed: prompt choice, synthetic task seed and token sampling (evaluation uses 42)
        tasks: synthetic task families the prompts cycle through (empty: prose only)
        pydoc: whether every other prompt is a window of CPython's bundled prose (False: tasks only)
    """

    prompts: int = 16
    heldout: int = 4
    length: int = 768
    tokens_per_prompt: int = 512
    n_sink: int = 4
    seed: int = 1234
    tasks: tuple[str, ...] = SYNTHETIC_TASKS
    pydoc: bool = True

    def __post_init__(self) -> None:
        for name in ("prompts", "heldout", "length", "tokens_per_prompt"):
            value = getattr(self, name)
            low = 0 if name == "heldout" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or not 0 <= self.n_sink < self.length:
            raise InvalidParameterError(f"n_sink must be an integer in [0, length), got {self.n_sink!r}")
        if self.length < 64:
            raise InvalidParameterError(f"length must be at least 64 tokens, got {self.length}")
        if not self.tasks and not self.pydoc:
            raise InvalidParameterError("tasks is empty and pydoc is False: no calibration text left")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class KVzipTargets:
    """One prompt's targets.

    Attributes:
        hidden: ``[layers, n, hidden_size]`` the hidden states entering each layer's attention (fp32, CPU)
        scores: ``[layers, kv_heads, n]`` KVzip's scores (fp32, CPU; the first ``n_sink`` are pinned at 2)
        source: where the prompt came from
    """

    hidden: torch.Tensor
    scores: torch.Tensor
    source: str


def log_scores(scores: torch.Tensor) -> torch.Tensor:
    """``log(max(score, SCORE_FLOOR))``: the regression target (KVzip's scores span many orders of magnitude)."""
    return scores.clamp(min=SCORE_FLOOR).log()


def _pydoc_windows(tokenizer: Any, length: int) -> list[tuple[str, torch.Tensor]]:
    from pydoc_data.topics import topics

    windows = []
    for key in sorted(topics):
        ids = tokenizer(topics[key], add_special_tokens=False, return_tensors="pt").input_ids[0]
        for start in range(0, len(ids) - length + 1, length):
            windows.append((f"pydoc:{key}@{start}", ids[start : start + length]))
    return windows


def calibration_prompts(
    tokenizer: Any, count: int, settings: TargetSettings
) -> list[tuple[str, torch.Tensor]]:
    """``count`` prompts of at most ``settings.length`` tokens as ``(source, ids [1, n])``: a pydoc window and a
    synthetic task sample in turn (one kind only when the settings leave out the other); each wrapped in the chat
    template's context part."""
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template

    template = prompt_template(tokenizer)
    special = template.prefix == ""
    length, seed, tasks = settings.length, settings.seed, settings.tasks
    body = max(32, length - 16)  # room for the template's opening
    kinds = (["pydoc"] if settings.pydoc else []) + (["task"] if tasks else [])
    plan = [kinds[i % len(kinds)] for i in range(count)]
    windows, order, samples = [], [], {}
    if "pydoc" in plan:
        windows = _pydoc_windows(tokenizer, body)
        if not windows:
            raise InvalidParameterError(f"length={length}: no pydoc topic is that long")
        order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
    if "task" in plan:
        per_task = -(-plan.count("task") // len(tasks))
        samples = {t: generate_task(t, tokenizer, body, per_task, seed=seed) for t in tasks}
    out, used = [], {"pydoc": 0, "task": 0}
    for kind in plan:
        j = used[kind]
        used[kind] += 1
        if kind == "pydoc":
            source, ids = windows[order[j % len(windows)]]
            text = tokenizer.decode(ids)
        else:
            task, k = tasks[j % len(tasks)], j // len(tasks)
            source, text = f"{task}#{k}", samples[task][k].context
        prompt = tokenizer(template.context_part(text), add_special_tokens=special, return_tensors="pt").input_ids
        out.append((source, prompt[:, :length]))
    return out


def kvzip_targets(model: torch.nn.Module, ids: torch.Tensor, source: str = "") -> KVzipTargets:
    """Prefill ``ids`` ``[1, n]`` with the ``kvzip`` method's cache, recording every layer's attention input, and
    run KVzip's reconstruction pass for the scores (one prompt; ``model`` in eval mode)."""
    from kvtrim.compression.compressor import layer_views
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.integration.hidden_states import attention_modules
    from kvtrim.runtime import resolve_method

    if ids.dim() != 2 or ids.shape[0] != 1:
        raise InvalidParameterError(f"ids must be [1, n], got {tuple(ids.shape)}")
    pipeline, spec = resolve_method("kvzip", 0.5, None, {}, model)
    layers = model.config.num_hidden_layers
    cache = KVTrimCache(layers, pipeline, spec, auto_compress=False)
    hidden: dict[int, torch.Tensor] = {}

    def grab(module, args, kwargs) -> None:
        h = kwargs.get("hidden_states", args[0] if args else None)
        hidden.setdefault(int(module.layer_idx), h[0].detach().float().cpu())

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in attention_modules(model)]
    try:
        with torch.inference_mode(), kvtrim_attention_enabled(model):
            model(ids.to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    with torch.inference_mode():
        context = (cache.kv_layers[0].store.positions.amax(dim=(1, 2)) + 1).clamp(min=0)
        views = layer_views(cache, context)
        pipeline.scorer.prepare(views)
        scores = views[0].shared["kvzip_scores"]
        stacked = torch.stack([scores[v.layer_idx][0].float().cpu() for v in views])
    return KVzipTargets(torch.stack([hidden[i] for i in range(layers)]), stacked, source)
