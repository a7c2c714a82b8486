"""vLLM's CPU attention with per-head lengths: the backend kvtrim registers over ``CPU_ATTN``.

``HeadFoldingCPUAttentionBackend`` is vLLM's ``CPUAttentionBackend`` with another impl: while a step holds
requests whose KV heads keep different counts (per-head methods, :class:`kvtrim.vllm.worker_patch.HeadStep`),
the cache write and the attention call fold every (request, KV head) into a one-head sequence over the head's
own sub-pages (:mod:`kvtrim.vllm.folded_attention`). Other requests of the same step are folded with vLLM's own
placement (head ``h`` of block ``b`` is sub-page ``b·H + h``), which is exactly where vLLM's kernels put and read
them. In any other step, and in every process without a per-head configuration, each call is vLLM's own.

``CpuPlatform.get_attn_backend_cls`` ignores ``--attention-backend`` and returns ``CPU_ATTN``'s path, which
``register_backend`` overrides (``kvtrim.vllm.plugin.register``).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import worker_patch
from .folded_attention import folded_attention, folded_cache_write


def _layer_index(layer) -> int:
    return worker_patch._layer_index(layer.layer_name)


def _format(impl, layer) -> tuple[float, float, str]:
    """``(k_scale, v_scale, kv_cache_dtype)`` as vLLM's own calls pass them (an fp8 cache: per-tensor scales)."""
    return layer._k_scale_float, layer._v_scale_float, impl.kv_cache_dtype


class HeadFoldingCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl; folds KV heads into the batch in steps with per-head requests."""

    def plain_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's own cache write, whatever the step (kvtrim's layout probe uses it)."""
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    def _folding(self):
        step = worker_patch.active_head_step()
        if step is None or self.attn_type != AttentionType.DECODER:
            return None
        if self.sinks is not None or self.alibi_slopes is not None or self.sliding_window != -1:
            raise NotImplementedError(
                "kvtrim's per-head budgets support causal attention without sinks, ALiBi or a sliding window"
            )
        return step

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        step = self._folding()
        if step is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        slots = step.write_slots(slot_mapping, kv_cache.shape[1], kv_cache.shape[2])[_layer_index(layer)]  # [n, H]
        folded_cache_write(key[:n], value[:n], kv_cache, slots, layer.isa, *_format(self, layer))

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = self._folding()
        if step is None or attn_metadata is None or output_scale is not None or output_block_scale is not None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        layer_idx = _layer_index(layer)
        kv_heads = self.num_kv_heads
        n = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc
        num_reqs = qsl.numel() - 1
        tables, lengths = step.attention_tables(
            attn_metadata.block_table[:num_reqs], attn_metadata.seq_lens[:num_reqs], kv_heads
        )
        folded_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            kv_cache,
            output[:n].view(n, self.num_heads, self.head_size),
            qsl,
            lengths[layer_idx],
            tables[layer_idx],
            self.scale,
            layer.isa,
            self.logits_soft_cap,
            *_format(self, layer),
            rows=step.rows_of(qsl, kv_heads),
        )
        return output


class HeadFoldingCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend whose impl folds KV heads in steps with per-head requests."""

    @staticmethod
    def get_impl_cls() -> type[HeadFoldingCPUAttentionImpl]:
        return HeadFoldingCPUAttentionImpl
