"""Paged per-head KV storage (KV-Compress layout) and a transformers ``Cache`` over a batch of paged sequences.

Every (sequence, layer, KV head) owns a block table: a list of blocks from a shared :class:`BlockPool`, filled
front to back, and its own length. Heads of the same sequence may therefore hold different numbers of entries,
and memory is exactly the entries plus at most one partial block per (layer, head).

A forward pass of the model with ``attn_implementation="kvtrim"`` and a :class:`PagedBatchCache` writes the new
keys and values into the sequences' blocks and attends through the block tables, the same protocol as
:class:`~kvtrim.cache.layer.CompressibleLayer`: ``update`` hands the pending K/V over, kvtrim's attention function
calls :meth:`PagedLayer.attend`.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import InvalidParameterError
from .attention import grouped_attention
from .block_pool import EMPTY, BlockPool, OutOfBlocks
from .layer import hand_over, raise_if_unconsumed
from .paged_kernels import PagedKernel, accumulate_metric_from_lse, paged_decode_attention, resolve_decode_kernel
from .sdpa import sdpa

__all__ = [
    "BlockPool",
    "OutOfBlocks",
    "PagedBatchCache",
    "PagedLayer",
    "PagedSequence",
]


def _ceil_div(a: torch.Tensor | int, b: int):
    return -(-a // b)


class PagedSequence:
    """Block tables of one sequence: one table and one length per (layer, KV head).

    Row ``r = layer * kv_heads + head`` indexes the tables. Entries of a row occupy logical slots ``0..length-1``;
    logical slot ``i`` lives in block ``table[i // block_size]`` at offset ``i % block_size``. The tables are the
    sequence's slot of the pool's shared device-resident :class:`~kvtrim.cache.block_tables.BlockTables`.

    Attributes:
        seen: tokens seen (the next token's logical position)
        store, slot: the shared tables and this sequence's index in them
    """

    def __init__(self, pool: BlockPool, num_layers: int, kv_heads: int):
        if num_layers <= 0 or kv_heads <= 0:
            raise InvalidParameterError(f"num_layers and kv_heads must be positive, got {num_layers}, {kv_heads}")
        self.pool = pool
        self.num_layers, self.kv_heads = num_layers, kv_heads
        self.seen = 0
        self.store = pool.block_tables(num_layers * kv_heads)
        self.slot = self.store.acquire()
        weakref.finalize(self, self.store.release_slot, self.slot)

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.kv_heads

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def _length(self) -> torch.Tensor:
        """``[rows]`` host lengths (a view into the shared tables)."""
        return self.store.host_length[self.slot]

    @property
    def _nblocks(self) -> torch.Tensor:
        return self.store.host_nblocks[self.slot]

    @property
    def tables(self) -> list[list[int]]:
        """Per row, the block ids in logical order (a host copy, for inspection)."""
        table = self.store.table[self.slot].cpu()
        return [table[r, :n].tolist() for r, n in enumerate(self._nblocks.tolist())]

    def lengths(self) -> torch.Tensor:
        """``[layers, kv_heads]`` stored entries."""
        return self._length.view(self.num_layers, self.kv_heads).clone()

    def row_lengths(self) -> torch.Tensor:
        """``[layers * kv_heads]`` stored entries per row (a copy)."""
        return self._length.clone()

    def blocks_held(self) -> int:
        return int(self._nblocks.sum())

    def entries(self) -> int:
        return int(self._length.sum())

    def blocks_needed(self, new_tokens: int) -> int:
        """Extra blocks an append of ``new_tokens`` to every row would allocate."""
        need = _ceil_div(self._length + new_tokens, self.block_size) - self._nblocks
        return int(need.clamp(min=0).sum())

    def kv_nbytes(self) -> int:
        """Key and value bytes of the entries actually stored (no slack)."""
        return self.entries() * self.pool.entry_nbytes()

    def held_nbytes(self) -> int:
        """Key and value bytes of the blocks this sequence holds (entries plus partial-block slack)."""
        return self.blocks_held() * self.pool.block_nbytes()

    # ------------------------------------------------------------------ block management
    def _slots(self) -> torch.Tensor:
        return torch.tensor([self.slot], dtype=torch.long)

    def reserve(self, new_tokens: int) -> None:
        """Allocate the blocks an append of ``new_tokens`` per row needs (all or nothing: :class:`OutOfBlocks`).
        Lengths are unchanged."""
        self.store.append(self._slots(), new_tokens, self.pool, grow_length=False)

    def release(self) -> None:
        """Free every block back to the pool (finish, preemption, cancellation); the sequence becomes empty."""
        slots = self._slots()
        dropped = self.store.shrink(slots, torch.zeros(1, self.num_rows, dtype=torch.long, device=self.pool.device))
        self.pool.free(dropped)
        self.seen = 0

    @torch.inference_mode()
    def set_row(self, row: int, blocks: list[int], length: int) -> None:
        """Make ``row`` hold ``length`` entries in ``blocks`` (already allocated to this sequence by the caller;
        for tests and tools that lay out a sequence by hand)."""
        if not 0 <= length <= len(blocks) * self.block_size:
            raise InvalidParameterError(f"length must lie in [0, {len(blocks) * self.block_size}], got {length}")
        self.store.ensure_width(len(blocks))
        self.store.table[self.slot, row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.store.host_nblocks[self.slot, row] = len(blocks)
        self.store.host_length[self.slot, row] = length
        if not self.store._shared:
            self.store.length[self.slot, row] = length

    def shrink_rows(self, new_lengths: torch.Tensor) -> torch.Tensor:
        """Set every row's length to ``new_lengths`` (``[rows]``, each <= its length); returns the now-unneeded
        trailing blocks of all rows (a device tensor, not yet freed)."""
        new_lengths = new_lengths.to(self.pool.device).view(1, -1)
        return self.store.shrink(self._slots(), new_lengths)

    def table_tensor(self) -> torch.Tensor:
        """``[layers * kv_heads, max_blocks]`` block ids (a view of the shared tables; entries beyond a row's block
        count are stale and masked by the lengths)."""
        width = max(1, int(self._nblocks.max()))
        return self.store.table[self.slot, :, :width]

    def slots(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat pool slot ids of every logical slot: ``([rows, max_blocks * block_size], valid mask)``.

        ``slot = block * block_size + offset`` is what ``pool.read_keys`` / ``pool.write`` take and indexes the
        flattened ``pool.positions`` / ``pool.metric``.
        """
        table = self.table_tensor()
        lengths = self.store.length[self.slot]
        if rows is not None:
            table, lengths = table[rows], lengths[rows]
        bs = self.block_size
        slot = (table[:, :, None] * bs + torch.arange(bs, device=table.device)).reshape(table.shape[0], -1)
        valid = torch.arange(slot.shape[1], device=table.device)[None, :] < lengths[:, None]
        return slot, valid

    def gather(self) -> dict[str, torch.Tensor]:
        """Copies of every row's entries in logical order, padded: keys/values ``[layers, kv_heads, S, head_dim]``,
        positions ``[layers, kv_heads, S]`` (-1 beyond the length), metric ``[layers, kv_heads, S]``."""
        slot, valid = self.slots()
        d = self.pool.head_dim
        shape = (self.num_layers, self.kv_heads, slot.shape[1])
        pos = self.pool.positions.view(-1)[slot].masked_fill(~valid, EMPTY)
        return {
            "keys": self.pool.read_keys(slot).view(*shape, d),
            "values": self.pool.read_values(slot).view(*shape, d),
            "positions": pos.view(shape),
            "metric": self.pool.metric.view(-1)[slot].view(shape),
            "valid": valid.view(shape),
        }

    def __repr__(self) -> str:
        return f"PagedSequence(seen={self.seen}, entries={self.entries()}, blocks={self.blocks_held()})"


class PagedLayer(CacheLayerMixin):
    """One model layer of a :class:`PagedBatchCache`: hands new K/V to kvtrim attention and attends over blocks."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: PagedBatchCache, layer_idx: int):
        self.is_initialized = True
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.keys = self.values = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cache(self) -> PagedBatchCache:
        return self._cache()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise_if_unconsumed(
            self.cache,
            "run the model with attn_implementation='kvtrim' (kvtrim.integration.attention.kvtrim_attention_enabled)",
        )
        if self.layer_idx == 0:
            if self.cache._prepared:  # begin_forward ran before the forward
                self.cache._prepared = False
            else:
                self.cache._begin_forward(key_states.shape[0], key_states.shape[2])
        hand_over(self, key_states, value_states)
        return key_states, value_states

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        position_ids: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Write the pending K/V into the blocks, attend over each (sequence, head)'s entries.

        Args:
            query: ``[n_seqs, q_heads, q, head_dim]`` post-rotary
            position_ids: ``[1 or n_seqs, q]`` or None (positions continue from each sequence's ``seen``)
            padding_mask: must be None or all True (paged batches are never padded)
        Returns:
            ``[n_seqs, q, q_heads, head_dim]``
        """
        keys, values = self._pending
        self._pending = None
        cache = self.cache
        cache._unconsumed = None
        if padding_mask is not None and not bool(padding_mask[:, -keys.shape[2] :].to(torch.bool).all()):
            raise InvalidParameterError("PagedBatchCache does not support padding: batch sequences of equal length")
        try:
            return cache._attend(self.layer_idx, query, keys, values, position_ids, scaling)
        finally:
            if self.layer_idx == cache.num_layers - 1:
                cache._step = None

    # transformers Cache protocol
    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._pending = None


class PagedBatchCache(Cache):
    """A transformers ``Cache`` over a list of :class:`PagedSequence` for forward passes of the model with
    ``attn_implementation="kvtrim"`` (see :func:`kvtrim.integration.attention.kvtrim_attention_enabled`).

    Prefill: ``input_ids [n, T]`` for ``n`` sequences of equal length (usually one, empty); decode:
    ``input_ids [n, 1]`` with ``position_ids [n, 1]`` = each sequence's ``seen`` (required when the sequences'
    ``seen`` differ). At layer 0 the blocks for the new tokens of every sequence are allocated at once; if the pool
    is short, :class:`OutOfBlocks` is raised before anything is written. Attention reads through the block tables
    and equals dense attention over the same entries.

    Args:
        model_config: the model's config (number of layers, KV heads, head size)
        pool: the shared block pool (its ``head_dim`` must match the model's)
        sequences: the batch, in input row order
        observe_window: record the last ``w`` queries of a prefill per layer in :attr:`observations` (for
            :func:`kvtrim.selection.block_eviction.prefill_metric`); 0 records nothing
        accumulate_decode_metric: each decode step adds every query head's squared attention, summed over the
            group, to ``pool.metric`` of each cached key (the paper's continual metric)
        buffer: keys within ``buffer`` positions of the query are left out of that accumulation
        chunk_lengths: packed (varlen) prefill: the input is ONE row holding, back to back, ``chunk_lengths[i]``
            new tokens of ``sequences[i]`` (``position_ids [1, sum]`` continue each sequence from its ``seen``).
            Each token attends only to its own sequence's entries: chunks of different lengths share one forward.
            Pass ``logits_to_keep=torch.tensor(cumsum(chunk_lengths) - 1)`` for each chunk's last logits.
        bucketed: static decode shapes (for CUDA graphs): a decode input may have more rows than ``sequences``
            (padding rows, position 0, that write and read only the pool's scratch block, so the pool needs
            ``scratch=True``), and every layer's block-table width is rounded up to a power of two.
        decode_kernel: decode attention (one query per sequence): ``"gather"`` gathers each (sequence, head)'s
            blocks and runs one masked SDPA per layer; ``"flash"`` runs one flash-attention block-table kernel call
            per layer, ``"triton"`` kvtrim's Triton kernel (metric fused) (:mod:`kvtrim.cache.paged_kernels`;
            both raise :class:`InvalidParameterError` saying why when they cannot); ``"auto"`` a kernel when one
            can run, else the gather path; or a :class:`~kvtrim.cache.paged_kernels.PagedKernel` the caller already
            resolved for this pool (an engine resolves once, not per forward). :attr:`decode_kernel_name` says which.
            A pool holding packed entries (:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`):
            ``"triton"`` (and ``"auto"`` on CUDA) runs the fused dequantizing Triton kernel
            (:mod:`kvtrim.cache.triton_paged_quant`, codes dequantized in registers), ``"gather"`` reads the
            gathered codes of one layer of the batch inside the attention call; ``"flash"`` raises.
    """

    def __init__(
        self,
        model_config,
        pool: BlockPool,
        sequences: list[PagedSequence],
        *,
        observe_window: int = 0,
        accumulate_decode_metric: bool = False,
        buffer: int = 0,
        chunk_lengths: list[int] | None = None,
        bucketed: bool = False,
        decode_kernel: str | PagedKernel = "gather",
    ):
        num_layers = model_config.num_hidden_layers
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        if head_dim != pool.head_dim:
            raise InvalidParameterError(f"pool head_dim={pool.head_dim} does not match the model's head_dim={head_dim}")
        if not sequences:
            raise InvalidParameterError("sequences must hold at least one PagedSequence")
        for s in sequences:
            if s.pool is not pool or s.num_layers != num_layers or s.kv_heads != kv_heads:
                raise InvalidParameterError(
                    f"every sequence must use this pool with num_layers={num_layers} and kv_heads={kv_heads}"
                )
        if len({id(s) for s in sequences}) != len(sequences):
            raise InvalidParameterError("a sequence appears twice in the batch")
        if isinstance(observe_window, bool) or not isinstance(observe_window, int) or observe_window < 0:
            raise InvalidParameterError(f"observe_window must be an integer >= 0, got {observe_window!r}")
        if buffer < 0:
            raise InvalidParameterError(f"buffer must be >= 0, got {buffer}")
        if chunk_lengths is not None:
            chunk_lengths = list(chunk_lengths)
            if len(chunk_lengths) != len(sequences) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in chunk_lengths
            ):
                raise InvalidParameterError(
                    f"chunk_lengths must hold one positive integer per sequence ({len(sequences)}), got {chunk_lengths}"
                )
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])
        self.pool = pool
        self.sequences = list(sequences)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.observe_window = observe_window
        self.accumulate_decode_metric = accumulate_decode_metric
        self.buffer = buffer
        self.chunk_lengths = chunk_lengths
        if bucketed and (pool.scratch_block is None or chunk_lengths is not None):
            raise InvalidParameterError("bucketed decode needs a BlockPool(scratch=True) and no chunk_lengths")
        self.bucketed = bucketed
        quant = None if pool.quant is None else pool.quant.name
        if isinstance(decode_kernel, PagedKernel):
            if quant is not None and quant not in decode_kernel.kv_quant:
                raise InvalidParameterError(
                    f"the {decode_kernel.name} kernel cannot read a pool with kv_quant={quant!r}: use the gather path"
                )
            if quant is None and decode_kernel.kv_quant:
                raise InvalidParameterError(f"the {decode_kernel.name} kernel reads quantized pools only")
            self._kernel = decode_kernel
        else:
            self._kernel = resolve_decode_kernel(
                decode_kernel, device=pool.device, dtype=pool.dtype, block_size=pool.block_size, head_dim=head_dim,
                kv_quant=pool.quant,
            )  # fmt: skip
        self.decode_kernel_name = "gather" if self._kernel is None else self._kernel.name
        # per layer: (queries [n, q_heads, w, head_dim], positions [n, w]) of the last prefill
        self.observations: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.scaling: float | None = None
        self._unconsumed: int | None = None
        self._step: dict | None = None  # per-forward state set at layer 0 (or by begin_forward)
        self._prepared = False

    # ------------------------------------------------------------------ transformers protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._step is not None:
            return self._step["seen_before"]
        return max(s.seen for s in self.sequences)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[-1])
        return self.get_seq_length() + q, 0

    # ------------------------------------------------------------------ forward
    def begin_forward(self, n: int, q: int, *, positions_checked: bool = False) -> None:
        """Do the next forward's host preparation now, before the forward (else layer 0 does it): allocate its
        blocks, write the block tables and upload the step's slots and positions. A decode step prepared this way
        runs its forward without a host-device synchronisation (the uploads are blocking copies from host memory).

        Args:
            n, q: the forward's input rows and tokens per row (``input_ids`` is ``[n, q]``)
            positions_checked: the caller built ``position_ids`` from each sequence's ``seen``, so the forward does
                not compare them on the device (that comparison reads a device value back)
        Raises:
            OutOfBlocks: the blocks do not fit (nothing changed)
        """
        self._begin_forward(n, q)
        if positions_checked:
            self._step["checked"] = True
        self._prepared = True

    def _begin_forward(self, n: int, q: int) -> None:
        """Layer 0: allocate every block this forward needs (all sequences, all layers) in one batch, or raise."""
        packed = self.chunk_lengths is not None
        if packed and (n != 1 or q != sum(self.chunk_lengths)):
            raise InvalidParameterError(
                f"a packed prefill takes one row of sum(chunk_lengths)={sum(self.chunk_lengths)} tokens, got [{n}, {q}]"
            )
        k = len(self.sequences)
        pad = n - k if self.bucketed and q == 1 else 0
        if not packed and n != k + pad:
            raise InvalidParameterError(f"the input has {n} rows but the PagedBatchCache holds {len(self.sequences)}")
        store = self.sequences[0].store
        slots = torch.tensor([s.slot for s in self.sequences], dtype=torch.long)  # host
        new = torch.tensor(self.chunk_lengths, dtype=torch.long)[:, None] if packed else q  # per sequence
        need = int(store.blocks_needed(slots, new).sum())
        if need > self.pool.num_free:
            raise OutOfBlocks(need, self.pool.num_free)
        before = [s.seen for s in self.sequences]
        fresh = bool((store.host_length[slots] == 0).all())  # host copy: no device read
        device = self.pool.device
        dev_slots = slots.to(device)
        store.append(slots, new, self.pool, grow_length=False)
        # Per layer, the widest table of this batch after the append (host arithmetic, no device read).
        blocks = store.host_nblocks[slots].view(k, self.num_layers, self.kv_heads)
        widths = blocks.amax(dim=(0, 2)).clamp(min=1).tolist()
        if self.bucketed:  # static shapes: padding rows on the padding slot, widths rounded up to powers of two
            widths = [1 << (w - 1).bit_length() for w in widths]
            store.ensure_width(max(widths))
            row_slots = torch.cat([slots, torch.full((pad,), store.padding_slot(self.pool.scratch_block))])
            row_dev_slots = row_slots.to(device)
            before_rows = before + [0] * pad
        else:
            row_dev_slots, before_rows = dev_slots, before
        rows = len(before_rows)
        base = store.length[row_dev_slots].view(rows, self.num_layers, self.kv_heads)  # a copy: lengths before
        store.add_length(slots, new, dev_slots)  # the lengths after this forward (attention reads ``base``)
        self._step = {
            "q": q,
            "seen_before": max(before),
            "seen": torch.tensor(before_rows, dtype=torch.long, device=device),
            "base": base,
            "slots": row_dev_slots,
            "widths": widths,
            "fresh": fresh,
        }
        if packed:
            lens = torch.tensor(self.chunk_lengths, dtype=torch.long)
            qmax = int(lens.max())
            start = torch.cumsum(lens, 0) - lens
            tok_seq = torch.repeat_interleave(torch.arange(k), lens)  # [q] sequence of each packed token
            tok_j = torch.arange(q) - start[tok_seq]  # its index inside its chunk
            t = torch.arange(qmax)[None, :] - (qmax - lens)[:, None]  # right-aligned padded layout [k, qmax]
            self._step.update(
                qmax=qmax,
                tok_seq=tok_seq.to(device),
                tok_j=tok_j.to(device),
                tok_t=(tok_j + qmax - lens[tok_seq]).to(device),
                pad_index=(start[:, None] + t).clamp(min=0).to(device),
                pad_valid=(t >= 0).to(device),
                lens=lens[:, None].to(device),
            )
        for s, m in zip(self.sequences, self.chunk_lengths or [q] * k, strict=True):
            s.seen += m

    def _positions(self, position_ids: torch.Tensor | None, n: int, q: int) -> torch.Tensor:
        step = self._step
        if "tok_seq" in step:  # packed: [1, q], each token continues its own sequence
            expected = (step["seen"][step["tok_seq"]] + step["tok_j"])[None]
        else:
            expected = step["seen"][:, None] + torch.arange(q, device=step["seen"].device)
        if position_ids is None:
            return expected
        pos = position_ids.to(expected.device).long().expand(n, q)
        if "checked" not in step:
            if not torch.equal(pos, expected):
                raise InvalidParameterError(
                    f"position_ids must continue each sequence from its `seen` ({step['seen'].tolist()}), "
                    f"got {pos[:, 0].tolist()}"
                )
            step["checked"] = True
        return pos

    def _attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position_ids: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        step = self._step
        pool = self.pool
        n, h, q, d = keys.shape
        bs = pool.block_size
        self.scaling = scaling
        qpos = self._positions(position_ids, n, q)  # [n, q]
        if "tok_seq" in step:
            return self._attend_packed(layer_idx, query, keys, values, qpos[0], scaling)
        base = step["base"][:, layer_idx]  # [n, H] lengths before this forward
        nb = step["widths"][layer_idx]
        rows = slice(layer_idx * h, (layer_idx + 1) * h)
        table = self.sequences[0].store.table[step["slots"], rows, :nb]  # [n, H, nb]: one gather per layer

        # Write the new entries into their slots.
        logical = base[:, :, None] + torch.arange(q, device=base.device)  # [n, H, q]
        block = torch.gather(table, 2, logical // bs)
        slot = (block * bs + logical % bs).reshape(-1)
        pool.write(slot, keys.reshape(-1, d), values.reshape(-1, d))
        pool.positions.view(-1)[slot] = qpos[:, None, :].expand(n, h, q).reshape(-1)
        pool.metric.view(-1).index_fill_(0, slot, 0.0)  # a scalar kernel argument, not a host tensor

        if self.observe_window and q > 1:
            w = min(self.observe_window, q)
            self.observations[layer_idx] = (query[:, :, -w:].detach().clone(), qpos[:, -w:].clone())

        if q == 1 and self._kernel is not None:
            return self._attend_kernel(query, table, base + 1, qpos, scaling)

        if step["fresh"] and not (self.accumulate_decode_metric and q == 1):
            # An empty sequence's prefill: the stored entries are exactly the new tokens, in order.
            return grouped_attention(query, keys, values, None, scaling, causal=True)

        # Gather every (sequence, head)'s entries through its block table: [n, H, S, d].
        length = base + q
        slots = (table[:, :, :, None] * bs + torch.arange(bs, device=table.device)).reshape(n, h, nb * bs)
        kpos = pool.positions.view(-1)[slots]
        stored = torch.arange(nb * bs, device=table.device)[None, None, :] < length[:, :, None]  # [n, H, S]
        mask = stored[:, :, None, :] & (kpos[:, :, None, :] <= qpos[:, None, :, None])  # [n, H, q, S]
        hq = query.shape[1]
        group = hq // h
        if q == 1 and pool.quant is not None and pool.per_token_scale:
            return self._decode_packed(query, slots, stored, kpos, mask, qpos, scaling)
        k = pool.read_keys(slots)  # a quantized pool dequantizes this layer's entries of the batch only
        v = pool.read_values(slots)
        if not (self.accumulate_decode_metric and q == 1):
            # Every query sees at least its own new key, so no row is empty (no NaN check, no host sync).
            qg = query.reshape(n, h, group * q, d)
            m = mask[:, :, None].expand(n, h, group, q, mask.shape[-1]).reshape(n, h, group * q, -1)
            out = sdpa(qg, k.to(query.dtype), v.to(query.dtype), attn_mask=m, scale=scaling)
            return out.reshape(n, hq, q, d).transpose(1, 2)

        logits = torch.matmul(query.reshape(n, h, group * q, d).float() * scaling, k.float().transpose(-1, -2))
        logits = logits.view(n, h, group, q, -1).masked_fill_(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(n, hq, q, -1)  # [n, hq, 1, S] fp32, no empty row (see above)
        out = torch.matmul(probs.view(n, h, group * q, -1), v.float()).view(n, hq, q, d)
        sq = probs.view(n, h, group, q, -1).square().sum(dim=(2, 3))  # [n, H, S]
        counted = stored & (kpos <= qpos[:, -1:, None] - self.buffer) if self.buffer else stored
        # Slots beyond a row's length add exactly 0 (no boolean indexing: its size would need a host read).
        pool.metric.view(-1).index_add_(0, slots.reshape(-1), (sq * counted).reshape(-1))
        return out.to(query.dtype).transpose(1, 2)

    def _decode_packed(self, query, slots, stored, kpos, mask, qpos, scaling) -> torch.Tensor:
        """One decode step over a quantized pool's packed entries, never dequantized: logits from the key codes and
        the output from the value codes (:meth:`QuantizedBlockPool.key_logits
        <kvtrim.cache.quantized_block_pool.QuantizedBlockPool.key_logits>`), float32, the continual metric added
        when asked for. ``query [n, q_heads, 1, d]``, ``slots [n, H, S]``; returns ``[n, 1, q_heads, d]``."""
        n, hq, _, d = query.shape
        h = slots.shape[1]
        qg = query.reshape(n, h, hq // h, d).float() * scaling
        logits = self.pool.key_logits(qg, slots).masked_fill_(~mask, float("-inf"))  # [n, H, G, S]
        probs = torch.softmax(logits, dim=-1)  # no empty row: every query sees its own new key
        out = self.pool.weighted_values(probs, slots)  # [n, H, G, d]
        if self.accumulate_decode_metric:
            sq = probs.square().sum(dim=2)  # [n, H, S]
            counted = stored & (kpos <= qpos[:, -1:, None] - self.buffer) if self.buffer else stored
            self.pool.metric.view(-1).index_add_(0, slots.reshape(-1), (sq * counted).reshape(-1))
        return out.reshape(n, hq, 1, d).to(query.dtype).transpose(1, 2)

    def _attend_kernel(self, query, table, length, qpos, scaling) -> torch.Tensor:
        """Decode through the block-table kernel (one call for the layer); ``length [n, H]`` after the write."""
        fused = self.accumulate_decode_metric and self._kernel.fuses_metric  # the Triton kernel adds it itself
        out, lse = paged_decode_attention(
            self._kernel, query, self.pool, table, length, scaling, metric_qpos=qpos if fused else None,
            buffer=self.buffer,
        )  # fmt: skip
        if self.accumulate_decode_metric and not fused:
            accumulate_metric_from_lse(self.pool, query, lse, table, length, qpos, scaling, self.buffer)
        return out

    def _attend_packed(
        self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scaling
    ) -> torch.Tensor:
        """Packed prefill: ``query [1, q_heads, T, d]``, ``keys/values [1, H, T, d]`` of ``k`` chunks back to back,
        ``pos [T]``. Writes each token into its own sequence's blocks, then attends as a right-aligned padded batch
        ``[k, q_heads, qmax, d]`` over each sequence's entries (one gather, one SDPA); returns ``[1, T, q_heads, d]``.
        """
        step, pool = self._step, self.pool
        bs, d = pool.block_size, pool.head_dim
        h, hq = keys.shape[1], query.shape[1]
        k, qmax = len(self.sequences), step["qmax"]
        tok_seq, tok_j = step["tok_seq"], step["tok_j"]
        base = step["base"][:, layer_idx]  # [k, H]
        nb = step["widths"][layer_idx]
        rows = slice(layer_idx * h, (layer_idx + 1) * h)
        table = self.sequences[0].store.table[step["slots"], rows, :nb]  # [k, H, nb]

        logical = base[tok_seq] + tok_j[:, None]  # [T, H]
        block = torch.gather(table[tok_seq], 2, (logical // bs)[..., None])[..., 0]
        slot = (block * bs + logical % bs).T.reshape(-1)  # [H * T], head-major like keys[0]
        pool.write(slot, keys[0].reshape(-1, d), values[0].reshape(-1, d))
        pool.positions.view(-1)[slot] = pos.expand(h, -1).reshape(-1)
        pool.metric.view(-1).index_fill_(0, slot, 0.0)  # a scalar kernel argument, not a host tensor

        pad_index, pad_valid = step["pad_index"], step["pad_valid"]  # [k, qmax]
        qp = query[0][:, pad_index].transpose(0, 1)  # [k, hq, qmax, d]
        qpos = pos[pad_index]  # [k, qmax]
        if self.observe_window:
            w = min(self.observe_window, qmax)
            self.observations[layer_idx] = (qp[:, :, -w:].clone(), qpos.masked_fill(~pad_valid, EMPTY)[:, -w:].clone())

        length = base + step["lens"]  # [k, H] after the writes
        slots = (table[:, :, :, None] * bs + torch.arange(bs, device=table.device)).reshape(k, h, nb * bs)
        kk = pool.read_keys(slots).to(query.dtype)
        vv = pool.read_values(slots).to(query.dtype)
        kpos = pool.positions.view(-1)[slots]
        stored = torch.arange(nb * bs, device=table.device)[None, None, :] < length[:, :, None]  # [k, H, S]
        # Padding queries see every stored entry (no empty row, no NaN); their outputs are dropped.
        see = qpos.masked_fill(~pad_valid, torch.iinfo(torch.long).max)
        mask = stored[:, :, None, :] & (kpos[:, :, None, :] <= see[:, None, :, None])  # [k, H, qmax, S]
        group = hq // h
        m = mask[:, :, None].expand(k, h, group, qmax, mask.shape[-1]).reshape(k, h, group * qmax, -1)
        out = sdpa(qp.reshape(k, h, group * qmax, d), kk, vv, attn_mask=m, scale=scaling).reshape(k, hq, qmax, d)
        return out[tok_seq, :, step["tok_t"]][None]  # [1, T, hq, d]

    # ------------------------------------------------------------------ accounting
    def kv_nbytes(self) -> int:
        """Key and value bytes of the blocks the batch's sequences hold."""
        return sum(s.held_nbytes() for s in self.sequences)
