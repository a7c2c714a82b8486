"""Device-resident block tables of every paged sequence of one pool (KV-Compress's per-head tables).

One :class:`BlockTables` holds, for every sequence that shares a :class:`~kvtrim.cache.block_pool.BlockPool` and
has ``rows = layers × kv_heads`` tables, the block ids of each (sequence, layer, KV head) in one tensor
``table [slots, rows, width]`` on the pool's device, and the entries each row stores in ``length [slots, rows]``.
A sequence owns one slot. Appends and evictions update both in place, for a whole batch of sequences in a few
tensor ops; decode attention reads ``table[batch_slots]`` and ``length[batch_slots]`` directly.

The tables are inference tensors: every update runs in inference mode (the engine's tensors are made in it), so
they can be changed from inside and outside it alike.

Block *allocation* is decided on the host (the free list is a Python stack, as in vLLM), so the host keeps its
own copy of the lengths and block counts (``host_length``, ``host_nblocks``): deciding how many blocks a step
needs never reads the device. On a CPU pool the host and device copies are the same tensors.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError


def ceil_div(a, b: int):
    return -(-a // b)


class BlockTables:
    """Block tables and lengths of all sequences with ``rows`` tables on one pool.

    Attributes:
        table: ``[slots, rows, width]`` long block ids on the pool's device; entries at or beyond a row's block
            count are stale and never read unmasked
        length: ``[slots, rows]`` long stored entries per row, on the pool's device
        host_length, host_nblocks: ``[slots, rows]`` long host copies (allocation decisions)
    """

    def __init__(self, rows: int, block_size: int, device, slots: int = 8, width: int = 4):
        if rows <= 0:
            raise InvalidParameterError(f"rows must be positive, got {rows}")
        self.rows, self.block_size = rows, block_size
        self.device = torch.device(device)
        self.table = torch.zeros(slots, rows, width, dtype=torch.long, device=self.device)
        self.host_length = torch.zeros(slots, rows, dtype=torch.long, device="cpu")
        self.host_nblocks = torch.zeros(slots, rows, dtype=torch.long, device="cpu")
        self.length = self.host_length if self._shared else self.host_length.to(self.device)
        self._free_slots = list(range(slots - 1, -1, -1))
        self._padding_slot: int | None = None

    @property
    def _shared(self) -> bool:
        return self.device.type == "cpu"

    @property
    def width(self) -> int:
        return self.table.shape[2]

    # ------------------------------------------------------------------ slots
    @torch.inference_mode()
    def acquire(self) -> int:
        """A free slot (grown by doubling when none is left); its rows are empty."""
        if not self._free_slots:
            old = self.table.shape[0]
            self._grow(slots=2 * old)
            self._free_slots = list(range(2 * old - 1, old - 1, -1))
        return self._free_slots.pop()

    @torch.inference_mode()
    def padding_slot(self, scratch_block: int) -> int:
        """A slot for the padding rows of a bucketed decode batch: length 0 in every row, its first block the pool's
        scratch block, never given blocks (so a padding row writes and reads only the scratch block)."""
        if self._padding_slot is None:
            self._padding_slot = self.acquire()
            self.table[self._padding_slot, :, 0].fill_(scratch_block)
        return self._padding_slot

    @torch.inference_mode()
    def release_slot(self, slot: int) -> None:
        """Give a slot back (its blocks must already be freed)."""
        self.host_length[slot].zero_()
        self.host_nblocks[slot].zero_()
        if not self._shared:
            self.length[slot].zero_()  # a fill kernel: no Python number copied to the device
        self._free_slots.append(slot)

    @torch.inference_mode()
    def _grow(self, slots: int | None = None, width: int | None = None) -> None:
        s, r, w = self.table.shape
        slots, width = slots or s, width or w
        table = torch.zeros(slots, r, width, dtype=torch.long, device=self.device)
        table[:s, :, :w] = self.table
        self.table = table
        host_length = torch.zeros(slots, r, dtype=torch.long, device="cpu")
        host_nblocks = torch.zeros(slots, r, dtype=torch.long, device="cpu")
        host_length[:s], host_nblocks[:s] = self.host_length, self.host_nblocks
        if self._shared:
            self.length = host_length
        else:
            length = torch.zeros(slots, r, dtype=torch.long, device=self.device)
            length[:s] = self.length
            self.length = length
        self.host_length, self.host_nblocks = host_length, host_nblocks

    def ensure_width(self, blocks: int) -> None:
        """Room for ``blocks`` blocks per row (the table width doubles until it fits)."""
        if blocks > self.width:
            width = self.width
            while width < blocks:
                width *= 2
            self._grow(width=width)

    # ------------------------------------------------------------------ batch updates
    def blocks_needed(self, slots: torch.Tensor, new_tokens) -> torch.Tensor:
        """``[len(slots), rows]`` blocks an append of ``new_tokens`` (an int, or ``[len(slots), 1]`` host long: one
        count per sequence) to every row of ``slots`` (host) allocates."""
        need = ceil_div(self.host_length[slots] + new_tokens, self.block_size) - self.host_nblocks[slots]
        return need.clamp(min=0)

    @torch.inference_mode()
    def append(self, slots: torch.Tensor, new_tokens, pool, *, grow_length: bool = True) -> None:
        """Allocate the blocks ``new_tokens`` more entries per row need, for every row of ``slots`` (``[n]`` host
        long) at once, write them into the tables and (``grow_length``) add ``new_tokens`` to the lengths.
        All or nothing: :class:`~kvtrim.cache.block_pool.OutOfBlocks` leaves everything unchanged."""
        need = self.blocks_needed(slots, new_tokens)  # [n, rows] host
        total = int(need.sum())
        if total:
            ids = pool.allocate_tensor(total)  # raises before anything changes
            nblocks = self.host_nblocks[slots]
            self.ensure_width(int((nblocks + need).max()))
            flat_need = need.reshape(-1)
            owner = torch.repeat_interleave(torch.arange(flat_need.numel()), flat_need)  # (slot, row) of each id
            first = torch.cumsum(flat_need, 0) - flat_need
            col = nblocks.reshape(-1)[owner] + torch.arange(total) - first[owner]
            s_idx = slots[owner // self.rows]
            r_idx = owner % self.rows
            self.table[s_idx.to(self.device), r_idx.to(self.device), col.to(self.device)] = ids.to(self.device)
            self.host_nblocks[slots] = nblocks + need
        if grow_length:
            self.add_length(slots, new_tokens)

    @torch.inference_mode()
    def add_length(self, slots: torch.Tensor, tokens, device_slots: torch.Tensor | None = None) -> None:
        """Add ``tokens`` (an int or ``[len(slots), 1]`` host long) to every row length of ``slots``."""
        self.host_length[slots] += tokens
        if not self._shared:
            dev = slots.to(self.device) if device_slots is None else device_slots
            self.length[dev] += tokens.to(self.device) if isinstance(tokens, torch.Tensor) else tokens

    @torch.inference_mode()
    def shrink(
        self,
        slots: torch.Tensor,
        new_length: torch.Tensor,
        *,
        device_slots: torch.Tensor | None = None,
        device_nblocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Set the lengths of ``slots``' rows to ``new_length`` (``[n, rows]``, on the device, each <= the
        current length) and return the block ids no longer needed (``[k]`` on the device; not yet freed).

        ``device_slots`` (``[n]``) and ``device_nblocks`` (``[n, rows]``, the block counts before): device copies
        of ``slots`` and of their host block counts the caller already has (else each is copied here)."""
        dev_slots = slots.to(self.device) if device_slots is None else device_slots
        new_nblocks_dev = ceil_div(new_length, self.block_size)
        host_new = new_length.to("cpu")  # the allocator needs the new counts: one copy per compression
        new_nblocks = ceil_div(host_new, self.block_size)
        old_nblocks = self.host_nblocks[slots]
        width = int(old_nblocks.max()) if old_nblocks.numel() else 0
        dropped = torch.empty(0, dtype=torch.long, device=self.device)
        if width:
            col = torch.arange(width, device=self.device)
            old_dev = old_nblocks.to(self.device) if device_nblocks is None else device_nblocks
            gone = (col >= new_nblocks_dev[..., None]) & (col < old_dev[..., None])
            dropped = self.table[dev_slots, :, :width][gone]
        self.host_length[slots] = host_new
        self.host_nblocks[slots] = new_nblocks
        if not self._shared:
            self.length[dev_slots] = new_length
        return dropped
