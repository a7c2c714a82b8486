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
from .folded_attention import default_subpage_slots, default_subpage_table, folded_attention, folded_cache_write


def _layer_index(layer) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer.layer_name)


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
        layer_idx = _layer_index(layer)
        n = slot_mapping.shape[0]
        slots = default_subpage_slots(slot_mapping, kv_cache.shape[1], kv_cache.shape[2])  # [n, H]
        for _, qs, qe, _, per_layer in step.rows:
            slots[qs:qe] = torch.from_numpy(per_layer[layer_idx]).to(slots.device)
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
        table = default_subpage_table(attn_metadata.block_table[:num_reqs].to(torch.int32), kv_heads)
        seq_lens = attn_metadata.seq_lens[:num_reqs].to(torch.int32).repeat_interleave(kv_heads)
        width = max(len(p) for *_, pages, _ in step.rows for p in pages.table(layer_idx))
        if width > table.shape[1]:
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        for i, _, _, pages, _ in step.rows:
            for h, head_pages in enumerate(pages.table(layer_idx)):
                table[i * kv_heads + h, : len(head_pages)] = torch.tensor(head_pages, dtype=torch.int32)
                seq_lens[i * kv_heads + h] = int(pages.lengths[layer_idx, h])
        folded_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            kv_cache,
            output[:n].view(n, self.num_heads, self.head_size),
            qsl,
            seq_lens,
            table,
            self.scale,
            layer.isa,
            self.logits_soft_cap,
            *_format(self, layer),
        )
        return output


class HeadFoldingCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend whose impl folds KV heads in steps with per-head requests."""

    @staticmethod
    def get_impl_cls() -> type[HeadFoldingCPUAttentionImpl]:
        return HeadFoldingCPUAttentionImpl
