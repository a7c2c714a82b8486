"""A decode step with static shapes and static input buffers: what a CUDA graph can capture and replay.

A bucketed decode forward through :class:`~kvtrim.cache.paged.PagedBatchCache` decides things on the host INSIDE
the forward (block allocation at layer 0, tensors built from Python lists, a device check of the positions, per
layer widths). A captured graph replays none of that Python: it replays fixed kernels on fixed addresses. So the
step is split in two:

1. :func:`reserve_decode_step` and :meth:`StaticDecodeCache.load`, on the host BEFORE the forward: allocate the
   new token's blocks of every real row through the shared tables, pick the batch bucket ``b`` and the table width
   ``W``, and write the inputs IN PLACE into preallocated buffers: token ids ``[b, 1]``, positions ``[b, 1]`` (the
   sequences' ``seen``; padding rows 0), each row's table slot ``[b]`` (padding rows: the pool's padding slot) and
   each row's lengths before the step ``[b, layers, kv_heads]``; then the lengths grow by one.
2. The forward itself (the model with a :class:`StaticDecodeCache`), which reads only those buffers, the pool and
   the shared block table: no allocation, no host read, no tensor from Python data, no data-dependent shape, the
   same ops with the same arguments for every step of one ``(b, W)`` key. The continual KV-Compress metric
   (``accumulate_decode_metric``) is accumulated inside it.

One width ``W`` (a power of two >= the widest table of the batch, over all layers) serves every layer: the number
of keys stays ``#batch buckets × log2(widest table)`` whatever the per-layer spread that compression produces
(per-layer widths would multiply the number of graphs by the combinations of layer widths). Narrower layers gather
a few more masked slots.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from .paged import PagedBatchCache, PagedSequence
from .paged_kernels import PagedKernel


def batch_bucket(n: int) -> int:
    """The padded decode batch size for ``n`` sequences: 1, 2, 4, 8, then the next multiple of 8 (as vLLM's
    CUDA-graph capture sizes)."""
    if n <= 0:
        raise InvalidParameterError(f"a decode batch holds at least one sequence, got {n}")
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def width_bucket(blocks: int) -> int:
    """The table width of a decode step whose widest table holds ``blocks`` blocks: the next power of two."""
    return 1 << (max(1, blocks) - 1).bit_length()


def reserve_decode_step(sequences: list[PagedSequence]) -> tuple[torch.Tensor, int]:
    """Allocate the blocks one more token of every row of ``sequences`` needs (all at once; on
    :class:`~kvtrim.cache.block_pool.OutOfBlocks` nothing changes), make the shared table at least as wide as the
    step's width bucket and make sure the padding slot exists: after this call the table does not move until the
    step has run. Lengths are unchanged. Returns ``(slots [n] host long, width W)``."""
    if not sequences:
        raise InvalidParameterError("sequences must hold at least one PagedSequence")
    store, pool = sequences[0].store, sequences[0].pool
    if any(s.store is not store for s in sequences):
        raise InvalidParameterError("every sequence of a decode step must share one pool and one geometry")
    slots = torch.tensor([s.slot for s in sequences], dtype=torch.long)
    if pool.scratch_block is None:
        raise InvalidParameterError("a static decode step needs a BlockPool(scratch=True) for its padding rows")
    store.append(slots, 1, pool, grow_length=False)
    width = width_bucket(int(store.host_nblocks[slots].max()))  # host bookkeeping, no device read
    store.ensure_width(width)
    store.padding_slot(pool.scratch_block)  # made now: taking a slot may reallocate the table a graph reads
    return slots, width


class StaticDecodeCache(PagedBatchCache):
    """A :class:`PagedBatchCache` for decode steps of one ``(batch b, width W)`` key whose inputs live in static
    buffers (see the module docstring). Load a step with :meth:`load`, then run the model on :attr:`input_ids` and
    :attr:`position_ids` with this cache; the forward's ops and their arguments do not depend on the step.

    Args:
        model_config, pool: as :class:`PagedBatchCache` (the pool needs ``scratch=True``: padding rows use it)
        sequences: any batch of at most ``batch`` sequences of this pool (sets the geometry; :meth:`load` replaces it)
        batch: rows of the static batch (a :func:`batch_bucket`)
        width: block-table width of every layer (a :func:`width_bucket`)
        accumulate_decode_metric, buffer, decode_kernel: as :class:`PagedBatchCache`

    Attributes:
        input_ids, position_ids: ``[b, 1]`` long device buffers (``position_ids`` is the rows' ``seen``)
        row_slots: ``[b]`` long, each row's slot in the shared tables
        base: ``[b, layers, kv_heads]`` long, each row's lengths before the step
    """

    def __init__(
        self,
        model_config,
        pool,
        sequences: list[PagedSequence],
        *,
        batch: int,
        width: int,
        accumulate_decode_metric: bool = False,
        buffer: int = 0,
        decode_kernel: str | PagedKernel = "gather",
    ):
        super().__init__(
            model_config, pool, sequences, accumulate_decode_metric=accumulate_decode_metric, buffer=buffer,
            bucketed=True, decode_kernel=decode_kernel,
        )  # fmt: skip
        if batch < len(sequences) or batch != batch_bucket(batch):
            raise InvalidParameterError(f"batch must be a batch bucket >= {len(sequences)}, got {batch}")
        if width != width_bucket(width):
            raise InvalidParameterError(f"width must be a power of two, got {width}")
        self.batch, self.width = batch, width
        self.store = sequences[0].store
        layers, heads, device = self.num_layers, self.kv_heads, pool.device
        # One device buffer with a view per input, filled from one host staging buffer: one copy per step.
        size = batch * (3 + layers * heads)
        self._device_buf = torch.zeros(size, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host_buf = torch.zeros(size, dtype=torch.long, device="cpu", pin_memory=pin)

        def views(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ids, seen, slots, base = buf.split([batch, batch, batch, batch * layers * heads])
            return ids.view(batch, 1), seen, slots, base.view(batch, layers, heads)

        self.input_ids, seen, self.row_slots, self.base = views(self._device_buf)
        self.position_ids = seen.view(batch, 1)
        self._host_ids, self._host_seen, self._host_slots, self._host_base = views(self._host_buf)
        self._static_step = {
            "q": 1,
            "seen_before": 0,
            "seen": seen,
            "base": self.base,
            "slots": self.row_slots,
            "widths": [width] * layers,
            "fresh": False,  # a decoding sequence is never empty; the gathered path equals the fresh one anyway
        }

    @torch.inference_mode()
    def load(self, sequences: list[PagedSequence], slots: torch.Tensor, tokens: list[int]) -> None:
        """Write one decode step into the static buffers: ``sequences`` (blocks already reserved by
        :func:`reserve_decode_step`, which gave ``slots``) feed ``tokens``; rows past ``len(sequences)`` are padding
        (token 0, position 0, the padding slot). Then every real row's length and ``seen`` grow by one."""
        n = len(sequences)
        if not 1 <= n <= self.batch or len(tokens) != n or slots.shape != (n,):
            raise InvalidParameterError(
                f"a step of this cache takes 1..{self.batch} sequences with one token and one slot each, got "
                f"{n} sequences, {len(tokens)} tokens, slots of shape {tuple(slots.shape)}"
            )
        store = self.store
        if int(store.host_nblocks[slots].max()) > self.width or store.width < self.width:
            raise InvalidParameterError(f"the batch's tables do not fit width {self.width}: reserve the step first")
        seen = [s.seen for s in sequences]
        self._host_ids.zero_()
        self._host_ids[:n, 0] = torch.tensor(tokens, dtype=torch.long)
        self._host_seen.zero_()
        self._host_seen[:n] = torch.tensor(seen, dtype=torch.long)
        self._host_slots.fill_(store.padding_slot(self.pool.scratch_block))
        self._host_slots[:n] = slots
        self._host_base.copy_(store.host_length[self._host_slots].view_as(self._host_base))  # host copy
        self._device_buf.copy_(self._host_buf)  # blocking: the host buffer is rewritten by the next step
        store.add_length(slots, 1, self.row_slots[:n])  # the lengths after the step (attention reads ``base``)
        for s in sequences:
            s.seen += 1
        self.sequences = list(sequences)
        self._static_step["seen_before"] = max(seen)  # host only (transformers' mask sizes; kvtrim ignores them)

    def load_padding(self, sequences: list[PagedSequence]) -> None:
        """Fill the buffers with padding rows only (a step that writes and reads only the scratch block): for
        warming up and capturing a graph without touching any sequence. ``sequences``: any sequences of this pool
        (the forward reaches the shared tables through them; their entries are neither read nor written)."""
        store = self.store
        if not sequences or any(s.store is not store for s in sequences):
            raise InvalidParameterError("load_padding needs at least one sequence of this cache's pool and geometry")
        self.sequences = list(sequences)
        self._static_step["seen_before"] = 0
        self._host_ids.zero_()
        self._host_seen.zero_()
        self._host_slots.fill_(store.padding_slot(self.pool.scratch_block))
        self._host_base.zero_()
        self._device_buf.copy_(self._host_buf)

    # ------------------------------------------------------------------ the forward reads only the buffers
    def _begin_forward(self, n: int, q: int) -> None:
        if n != self.batch or q != 1:
            raise InvalidParameterError(f"a static decode step takes input [{self.batch}, 1], got [{n}, {q}]")
        self._step = self._static_step

    def _positions(self, position_ids: torch.Tensor | None, n: int, q: int) -> torch.Tensor:
        # The positions are the sequences' ``seen``, written by ``load``: no check (it would read the device).
        return self.position_ids

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._static_step["seen_before"]
