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

:func:`collect_targets` keeps ``tokens_per_prompt`` random tokens of each training prompt and every token of the
held-out prompts, and caches them on disk (keyed by the model and the settings), so the second calibration that
needs the same targets skips the reconstruction passes. :func:`surrogate_fit` measures a surrogate against the
held-out targets.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrim.errors import InvalidParameterError

__all__ = [
    "KVzipTargets",
    "TargetSet",
    "TargetSettings",
    "calibration_prompts",
    "collect_targets",
    "kvzip_targets",
    "log_scores",
    "spearman",
    "surrogate_fit",
]

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


@dataclass
class TargetSet:
    """What a surrogate is trained and measured on.

    Attributes:
        x: ``[n, layers, hidden_size]`` training hidden states (float16)
        y: ``[n, layers, kv_heads]`` their KVzip scores (fp32)
        heldout: the held-out prompts' full targets (hidden states in float16)
        sources: every prompt's source, training prompts first
        seconds: wall time of the collection (when it was not read from the cache)
        cached: whether it was read from the cache
    """

    x: torch.Tensor
    y: torch.Tensor
    heldout: list[KVzipTargets]
    sources: list[str]
    seconds: float
    cached: bool = False


def _cache_file(model: torch.nn.Module, settings: TargetSettings, cache_dir: Path) -> Path:
    from kvtrim.artifacts.store import model_key

    digest = hashlib.sha256(json.dumps(settings.as_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir / f"{model_key(model)}-{digest}.pt"


def default_cache_dir() -> Path:
    """``$KVTRIM_HOME/kvzip_targets``."""
    from kvtrim.models import kvtrim_home

    return kvtrim_home() / "kvzip_targets"


def collect_targets(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: TargetSettings,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> TargetSet:
    """KVzip targets of the calibration prompts of ``settings``: ``tokens_per_prompt`` random tokens past the sinks
    of each training prompt, every token of the held-out ones. Read from ``cache_dir`` (default
    :func:`default_cache_dir`; ``False``-like ``""`` disables it) when a previous run saved them."""
    cache = None if cache_dir == "" else Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = _cache_file(model, settings, cache) if cache is not None else None
    if target is not None and target.is_file():
        data = torch.load(target, weights_only=True)
        parts = zip(data["hidden"], data["scores"], data["heldout"], strict=True)
        heldout = [KVzipTargets(h, sc, src) for h, sc, src in parts]
        return TargetSet(data["x"], data["y"], heldout, data["sources"], data["seconds"], cached=True)
    start = time.perf_counter()
    model.eval()
    prompts = calibration_prompts(tokenizer, settings.prompts + settings.heldout, settings)
    gen = torch.Generator().manual_seed(settings.seed)
    xs, ys, heldout = [], [], []
    for i, (source, ids) in enumerate(prompts):
        step = time.perf_counter()
        t = kvzip_targets(model, ids, source)
        if i < settings.prompts:
            n = t.hidden.shape[1]
            pick = settings.n_sink + torch.randperm(n - settings.n_sink, generator=gen)[: settings.tokens_per_prompt]
            xs.append(t.hidden[:, pick].transpose(0, 1).half())
            ys.append(t.scores[:, :, pick].permute(2, 0, 1).contiguous())
        else:
            heldout.append(KVzipTargets(t.hidden.half(), t.scores, source))
        if progress:
            kind = "train" if i < settings.prompts else "held-out"
            took = time.perf_counter() - step
            print(f"kvzip targets ({kind}) {i + 1}/{len(prompts)} {source}: {took:.1f} s", flush=True)
    out = TargetSet(torch.cat(xs), torch.cat(ys), heldout, [s for s, _ in prompts], time.perf_counter() - start)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "x": out.x,
            "y": out.y,
            "hidden": [t.hidden for t in heldout],
            "scores": [t.scores for t in heldout],
            "heldout": [t.source for t in heldout],
            "sources": out.sources,
            "seconds": out.seconds,
        }
        torch.save(payload, target)
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation along the last dimension (ties broken by order)."""

    def ranks(t: torch.Tensor) -> torch.Tensor:
        r = torch.empty_like(t, dtype=torch.float64)
        r.scatter_(-1, t.argsort(-1), torch.arange(t.shape[-1], dtype=torch.float64).expand_as(t).contiguous())
        return r - r.mean(-1, keepdim=True)

    ra, rb = ranks(a), ranks(b)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp(min=1e-12)


def _overlap(pred: torch.Tensor, true: torch.Tensor, keep: int) -> torch.Tensor:
    """Share of the true top-``keep`` along the last dimension that the predicted top-``keep`` also holds."""
    p = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, pred.topk(keep, dim=-1).indices, True)
    t = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(keep, dim=-1).indices, True)
    return (p & t).sum(-1).double() / keep


def surrogate_fit(
    predict: Any, heldout: list[KVzipTargets], n_sink: int, keep_fraction: float
) -> dict[str, Any]:
    """How well a surrogate ranks the held-out prompts' entries like KVzip (sinks left out).

    ``predict(layer, hidden [1, n, hidden_size]) -> [1, kv_heads, n]`` is the surrogate. Returns the mean Spearman
    correlation per (layer, KV head) (``spearman``, its minimum ``spearman_min`` and the ``[layers, kv_heads]``
    tensor ``spearman_per_head``), and the overlap of the kept sets at ``keep_fraction``: per head
    (``overlap_per_head``) and across all layers and heads at once (``overlap_global``, kvzip's global threshold).
    """
    rho, per_head, global_overlap = [], [], []
    for t in heldout:
        true = t.scores[:, :, n_sink:].double()
        hidden = t.hidden.float()
        pred = torch.stack([predict(layer, hidden[layer][None])[0] for layer in range(hidden.shape[0])])
        pred = pred[:, :, n_sink:].double()
        keep = max(1, round(keep_fraction * true.shape[-1]))
        rho.append(spearman(pred, true))
        per_head.append(_overlap(pred, true, keep).mean())
        global_overlap.append(_overlap(pred.flatten(), true.flatten(), keep * true.shape[0] * true.shape[1]))
    rho_mean = torch.stack(rho).mean(0)
    return {
        "spearman": float(rho_mean.mean()),
        "spearman_min": float(rho_mean.min()),
        "overlap_per_head": float(torch.stack(per_head).mean()),
        "overlap_global": float(torch.stack(global_overlap).mean()),
        "spearman_per_head": rho_mean.float(),
    }
