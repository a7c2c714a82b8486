"""Query statistics for Expected Attention (the ``expected_attention_stats`` artifact): per layer and query head,
the mean and covariance of the pre-RoPE queries over calibration prompts.

kvpress's ExpectedAttentionStatsPress (Devoto et al., arXiv 2510.00636) reads such statistics, computed offline on
100 BookSum chapters cut to 1,000 characters (first 4 positions left out, sample covariance), instead of the
prompt's own queries. kvtrim's procedure: the prompts of :mod:`kvtrim.calibration.kvzip_targets` (CPython's bundled
prose and kvtrim's synthetic tasks, seed 1234, the chat template's context part), prefilled with the
``expected_attention`` method's cache, which records every prompt query after RoPE; the queries are un-rotated with
the model's rotary frequencies exactly as that method does, the first ``n_sink`` positions left out, and
accumulated in float64 into a mean and a population covariance (``/n``, as the method's own statistics), stored
in float16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.artifacts.query_stats import EXPECTED_ATTENTION_STATS_KIND
from kvtrim.artifacts.store import save_artifact
from kvtrim.errors import InvalidParameterError

from .kvzip_targets import TargetSettings, calibration_prompts

__all__ = ["QueryStatsCalibration", "calibrate_query_stats"]


@dataclass(frozen=True)
class QueryStatsCalibration:
    """Settings of :func:`calibrate_query_stats` (recorded in the artifact).

    Attributes:
        prompts: calibration prompts (the prompt settings of ``prompts``; its ``heldout`` and ``tokens_per_prompt``
            are not used)
        n_sink: first positions left out of the statistics
    """

    prompts: TargetSettings = field(default_factory=lambda: TargetSettings(heldout=0))
    n_sink: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise InvalidParameterError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")

    def as_dict(self) -> dict:
        return {"prompts": self.prompts.as_dict(), "n_sink": self.n_sink}


def calibrate_query_stats(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: QueryStatsCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Accumulate the pre-RoPE query statistics of every layer over the calibration prompts and save the
    ``expected_attention_stats`` artifact (``query_mean`` ``[layers, q_heads, d]``, ``query_cov``
    ``[layers, q_heads, d, d]``, ``queries`` the count per layer); returns the ``.safetensors`` path."""
    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.methods import get_method
    from kvtrim.scoring.expected_attention import unrotate
    from kvtrim.scoring.rope import rope_frequencies

    settings = settings or QueryStatsCalibration()
    start = time.perf_counter()
    model.eval()
    prompts = calibration_prompts(tokenizer, settings.prompts.prompts, settings.prompts)
    layers = model.config.num_hidden_layers
    sums: list[torch.Tensor | None] = [None] * layers
    outer: list[torch.Tensor | None] = [None] * layers
    count = 0
    for i, (source, ids) in enumerate(prompts):
        step = time.perf_counter()
        cache = KVTrimCache(layers, get_method("expected_attention"), BudgetSpec(ratio=0.5), auto_compress=False)
        with torch.inference_mode(), kvtrim_attention_enabled(model):
            model(ids.to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
            for layer in cache.layers:
                obs, device = layer.observation, layer.store.keys.device
                inv_freq, scale = rope_frequencies(layer.module.config, layer.store.keys.shape[-1], device)
                q = unrotate(obs.queries.to(device), obs.positions.to(device), inv_freq, scale)[0]  # [h, n, d]
                q = q[:, obs.positions[0].to(device) >= settings.n_sink].double().cpu()
                idx = layer.layer_idx
                s, o = q.sum(1), q.transpose(1, 2) @ q
                sums[idx] = s if sums[idx] is None else sums[idx] + s
                outer[idx] = o if outer[idx] is None else outer[idx] + o
                n = q.shape[1]
        count += n
        if progress:
            print(f"query statistics {i + 1}/{len(prompts)} {source}: {time.perf_counter() - step:.1f} s", flush=True)
    if count == 0:
        raise InvalidParameterError("no query past the sinks: lengthen the prompts or lower n_sink")
    mean = torch.stack(sums) / count  # [layers, heads, d]
    cov = torch.stack(outer) / count - mean[..., :, None] * mean[..., None, :]
    tensors = {"query_mean": mean.half(), "query_cov": cov.half()}  # float16: the artifact ships in the package
    meta = {
        "settings": settings.as_dict(),
        "seconds": time.perf_counter() - start,
        "summary": {"queries_per_head": count, "prompts": [s for s, _ in prompts]},
        "threads": torch.get_num_threads(),
    }
    return save_artifact(EXPECTED_ATTENTION_STATS_KIND, model, tensors, meta, out_dir)
