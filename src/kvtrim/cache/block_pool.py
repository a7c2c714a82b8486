"""A fixed pool of KV blocks shared by every sequence, layer and KV head (paged storage).

A block holds ``block_size`` slots of one (sequence, layer, KV head): a key and a value of ``head_dim`` each, the
token's logical position and its KV-Compress eviction metric. Blocks are handed out and taken back in O(n) for n
blocks through a free list; nothing is ever copied when a sequence grows.

Entries are written, read and moved through :meth:`BlockPool.write`, :meth:`BlockPool.read_keys` /
:meth:`BlockPool.read_values` and :meth:`BlockPool.move`, so a pool that holds them packed
(:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`) serves the same callers.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from .block_tables import BlockTables

EMPTY = -1  # position of a slot that holds nothing


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than an allocation asked for; the pool is unchanged."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
    return value


def take(t: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``t[slot]`` for a ``[slots, ...]`` tensor and an index of any shape, through ``index_select`` (on CPU
    several times faster than advanced indexing with a multi-dimensional index)."""
    return t.index_select(0, slot.reshape(-1)).view(*slot.shape, *t.shape[1:])


def blocks_for_bytes(kv_bytes, per_block: int, what: str) -> int:
    """Whole blocks of ``per_block`` bytes in ``kv_bytes`` (at least one, else a clear error naming ``what``)."""
    if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < per_block:
        raise InvalidParameterError(
            f"kv_bytes must be an integer of at least one block ({per_block} bytes for {what}), got {kv_bytes!r}"
        )
    return kv_bytes // per_block


class BlockPool:
    """One physical pool shared by all sequences, layers and KV heads.

    Attributes:
        keys, values: ``[num_blocks, block_size, head_dim]``
        quant: how entries are held: None (in ``dtype``, this class) or a
            :class:`~kvtrim.cache.quant.KVQuant` (:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`)
        positions: ``[num_blocks, block_size]`` long, ``-1`` for an empty slot
        metric: ``[num_blocks, block_size]`` float32, the KV-Compress eviction metric of each slot
    """

    def __init__(
        self, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, device="cpu", scratch: bool = False
    ):
        _positive_int("num_blocks", num_blocks)
        _positive_int("block_size", block_size)
        _positive_int("head_dim", head_dim)
        self.num_blocks, self.block_size, self.head_dim = num_blocks, block_size, head_dim
        # ``scratch``: one more block, never handed out, that the padding rows of a bucketed (static-shape) decode
        # batch write into and read from (block id ``num_blocks``).
        self.scratch_block = num_blocks if scratch else None
        physical = num_blocks + int(scratch)
        self._dtype = dtype
        self._make_entries(physical, dtype, device)
        self.positions = torch.full((physical, block_size), EMPTY, dtype=torch.long, device=device)
        self.metric = torch.zeros(physical, block_size, dtype=torch.float32, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._allocated = torch.zeros(num_blocks, dtype=torch.bool, device="cpu")  # host bookkeeping
        self._tables: dict[int, BlockTables] = {}

    quant = None

    def _make_entries(self, physical: int, dtype: torch.dtype, device) -> None:
        """The key and value tensors of ``physical`` blocks."""
        self.keys = torch.zeros(physical, self.block_size, self.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    def block_tables(self, rows: int) -> BlockTables:
        """The shared device-resident block tables of the sequences with ``rows`` tables on this pool."""
        tables = self._tables.get(rows)
        if tables is None:
            tables = self._tables[rows] = BlockTables(rows, self.block_size, self.device)
        return tables

    @classmethod
    def for_bytes(
        cls, kv_bytes: int, block_size: int, head_dim: int, dtype: torch.dtype, device="cpu", scratch: bool = False
    ) -> BlockPool:
        """The largest pool whose keys and values fit in ``kv_bytes`` (plus the scratch block, if asked for)."""
        _positive_int("block_size", block_size)
        _positive_int("head_dim", head_dim)
        per_block = 2 * block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        what = f"block_size={block_size}, head_dim={head_dim}, {dtype}"
        return cls(blocks_for_bytes(kv_bytes, per_block, what), block_size, head_dim, dtype, device, scratch)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype entries are written from and read back in (the model's)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (their slots are empty). Raises :class:`OutOfBlocks` if fewer are free."""
        return self.allocate_tensor(n).tolist()

    def allocate_tensor(self, n: int) -> torch.Tensor:
        """:meth:`allocate` as a ``[n]`` host long tensor."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidParameterError(f"number of blocks to allocate must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return torch.empty(0, dtype=torch.long)
        ids = torch.tensor(self._free[-n:], dtype=torch.long)
        del self._free[-n:]
        self._allocated.index_fill_(0, ids, True)
        return ids

    def free(self, block_ids: list[int] | torch.Tensor) -> None:
        """Give blocks back. Freeing a block that is not allocated (or twice) raises; nothing changes then.

        ``block_ids`` may be a tensor on the pool's device (one copy to the host for the free list)."""
        if isinstance(block_ids, torch.Tensor):
            host = block_ids.to("cpu", torch.long).reshape(-1)
        else:
            host = torch.tensor([int(i) for i in block_ids], dtype=torch.long)
        if not host.numel():
            return
        if bool(((host < 0) | (host >= self.num_blocks)).any()):
            bad = int(host[(host < 0) | (host >= self.num_blocks)][0])
            raise ValueError(f"block id {bad} is outside the pool (0..{self.num_blocks - 1})")
        uniq, counts = torch.unique(host, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"block ids freed twice in one call: {uniq[counts > 1].tolist()}")
        if not bool(self._allocated[host].all()):
            bad = int(host[~self._allocated[host]][0])
            raise ValueError(f"block {bad} is not allocated (double free?)")
        self._allocated.index_fill_(0, host, False)
        self._free.extend(host.tolist())
        index = block_ids if isinstance(block_ids, torch.Tensor) and block_ids.device == self.device else None
        index = host.to(self.device) if index is None else index
        self.positions.index_fill_(0, index, EMPTY)  # no Python number through an index (a host→device copy)
        self.metric.index_fill_(0, index, 0.0)

    def is_allocated(self, block_id: int) -> bool:
        return bool(self._allocated[block_id])

    # ------------------------------------------------------------------ entries
    def write(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[m, head_dim]`` at flat slots ``slot`` ``[m]`` (``block * block_size +
        offset``); positions and metrics are the caller's."""
        d = self.head_dim
        self.keys.view(-1, d)[slot] = keys.to(self.dtype)
        self.values.view(-1, d)[slot] = values.to(self.dtype)

    def read_keys(self, slot: torch.Tensor) -> torch.Tensor:
        """The keys at flat slots ``slot`` (any shape ``[...]``) as ``[..., head_dim]`` in :attr:`dtype` (a copy)."""
        return take(self.keys.view(-1, self.head_dim), slot)

    def read_values(self, slot: torch.Tensor) -> torch.Tensor:
        """The values at flat slots ``slot`` as ``[..., head_dim]`` in :attr:`dtype` (a copy)."""
        return take(self.values.view(-1, self.head_dim), slot)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the entries (key, value, position, metric) at flat slots ``src`` ``[m]`` to ``dst`` ``[m]``."""
        for t in self._slot_tensors():
            t[dst] = t[src]

    def _entry_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding keys and values (what :meth:`nbytes` counts)."""
        return (self.keys, self.values)

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor as ``[slots, ...]`` views (what :meth:`move` carries)."""
        d = self.head_dim
        return (self.keys.view(-1, d), self.values.view(-1, d), self.positions.view(-1), self.metric.view(-1))

    # ------------------------------------------------------------------ accounting
    def block_nbytes(self) -> int:
        """Key and value bytes of one block."""
        return self.block_size * self.entry_nbytes()

    def entry_nbytes(self) -> int:
        """Key and value bytes of one slot (one entry of one KV head)."""
        return 2 * self.head_dim * self.keys.element_size()

    def nbytes(self) -> int:
        """Key and value bytes held by the pool tensors (all blocks, free or not)."""
        return sum(t.untyped_storage().nbytes() for t in self._entry_tensors())

    def index_nbytes(self) -> int:
        """Bytes of the per-slot positions and metrics."""
        return self.positions.untyped_storage().nbytes() + self.metric.untyped_storage().nbytes()

    def used_nbytes(self) -> int:
        """Key and value bytes of the allocated blocks."""
        return self.num_used * self.block_nbytes()

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, free={self.num_free})"
        )
