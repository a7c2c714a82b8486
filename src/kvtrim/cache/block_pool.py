"""A fixed pool of KV blocks shared by every sequence, layer and KV head (paged storage).

A block holds ``block_size`` slots of one (sequence, layer, KV head): a key and a value of ``head_dim`` each, the
token's logical position and its KV-Compress eviction metric. Blocks are handed out and taken back in O(n) for n
blocks through a free list; nothing is ever copied when a sequence grows.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError

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


class BlockPool:
    """One physical pool shared by all sequences, layers and KV heads.

    Attributes:
        keys, values: ``[num_blocks, block_size, head_dim]``
        positions: ``[num_blocks, block_size]`` long, ``-1`` for an empty slot
        metric: ``[num_blocks, block_size]`` float32, the KV-Compress eviction metric of each slot
    """

    def __init__(self, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, device="cpu"):
        _positive_int("num_blocks", num_blocks)
        _positive_int("block_size", block_size)
        _positive_int("head_dim", head_dim)
        self.num_blocks, self.block_size, self.head_dim = num_blocks, block_size, head_dim
        self.keys = torch.zeros(num_blocks, block_size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.full((num_blocks, block_size), EMPTY, dtype=torch.long, device=device)
        self.metric = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._allocated = bytearray(num_blocks)

    @classmethod
    def for_bytes(cls, kv_bytes: int, block_size: int, head_dim: int, dtype: torch.dtype, device="cpu") -> BlockPool:
        """The largest pool whose keys and values fit in ``kv_bytes``."""
        _positive_int("block_size", block_size)
        _positive_int("head_dim", head_dim)
        per_block = 2 * block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < per_block:
            raise InvalidParameterError(
                f"kv_bytes must be an integer of at least one block ({per_block} bytes for block_size={block_size}, "
                f"head_dim={head_dim}, {dtype}), got {kv_bytes!r}"
            )
        return cls(kv_bytes // per_block, block_size, head_dim, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (their slots are empty). Raises :class:`OutOfBlocks` if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidParameterError(f"number of blocks to allocate must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return []
        ids = self._free[-n:]
        del self._free[-n:]
        for i in ids:
            self._allocated[i] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back. Freeing a block that is not allocated (or twice) raises; nothing changes then."""
        ids = [int(i) for i in block_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"block ids freed twice in one call: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        for i in ids:
            if not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i} is outside the pool (0..{self.num_blocks - 1})")
            if not self._allocated[i]:
                raise ValueError(f"block {i} is not allocated (double free?)")
        if not ids:
            return
        for i in ids:
            self._allocated[i] = 0
        self._free.extend(ids)
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.positions[index] = EMPTY
        self.metric[index] = 0.0

    def is_allocated(self, block_id: int) -> bool:
        return bool(self._allocated[block_id])

    # ------------------------------------------------------------------ accounting
    def block_nbytes(self) -> int:
        """Key and value bytes of one block."""
        return 2 * self.block_size * self.head_dim * self.keys.element_size()

    def nbytes(self) -> int:
        """Key and value bytes held by the pool tensors (all blocks, free or not)."""
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

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
