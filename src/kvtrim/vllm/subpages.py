"""One-head sub-pages: every (request, layer, KV head) gets its own page list and length inside vLLM's blocks.

vLLM's CPU cache of a layer is ``[num_blocks, kv_heads, block_size, 2·head_dim]``, so
``view(num_blocks·kv_heads, 1, block_size, 2·head_dim)`` is free: sub-page ``b·H + j`` is the ``j``-th head slice
of block ``b`` and holds ``block_size`` entries of one head. A request owns all ``H`` sub-pages of each of its
blocks, in every layer (each layer has its own cache tensor, so the layers' sub-pages are independent). After
per-head compression, head ``h`` of layer ``l`` keeps ``k_{l,h}`` entries in ``⌈k_{l,h}/block_size⌉`` sub-pages
taken from that pool, and each decoded token goes to the next slot of the head's last sub-page (a new sub-page
from the pool when it is full).

Capacity: a layer whose heads keep ``Σ_h k_h ≤ H·B`` entries needs, after ``t`` decoded tokens,
``Σ_h ⌈(k_h + t)/bs⌉ ≤ H·(B + t + bs − 1)/bs`` sub-pages; a request holding the blocks of
``B + bs − 1 + t`` tokens owns ``H·⌈(B + bs − 1 + t)/bs⌉`` of them, always enough
(:func:`slots_for_head_budget`). The scheduler therefore stays uniform.
"""

from __future__ import annotations

import numpy as np


class SubPageError(RuntimeError):
    """A request's blocks cannot hold the entries its heads must keep (the capacity bound was violated)."""


def slots_for_head_budget(budget: int, prompt_len: int, block_size: int) -> int:
    """Slots (tokens of one uniform block list) a request keeps so that per-head counts with mean ``budget`` fit.

    ``min(budget + block_size − 1, prompt_len)``: either the capacity bound of the module docstring, or the whole
    prompt (every head keeps at most the prompt, so the prompt's own blocks hold any per-head split).
    """
    return min(budget + block_size - 1, prompt_len)


class RequestSubPages:
    """The sub-pages of one request in every layer: page ids ``[layers, heads, ≥ pages]``, lengths ``[layers,
    heads]``; head ``h`` of ``layer`` holds its entries in ``page_ids[layer, h, :⌈lengths[layer, h]/block_size⌉]``.

    Args:
        num_layers, kv_heads: the model's attention layers and (this rank's) KV heads
        block_size: entries per block, hence per sub-page
        blocks: the request's block ids, in order
    """

    def __init__(self, num_layers: int, kv_heads: int, block_size: int, blocks: list[int]) -> None:
        self.num_layers, self.kv_heads, self.block_size = num_layers, kv_heads, block_size
        self.blocks: list[int] = []
        self.page_ids = np.zeros((num_layers, kv_heads, 4), dtype=np.int64)  # grows as heads take pages
        self.free: list[list[int]] = [[] for _ in range(num_layers)]
        self.lengths = np.zeros((num_layers, kv_heads), dtype=np.int64)
        self.placed = np.zeros(num_layers, dtype=bool)  # layer's kept entries have been assigned pages
        self.add_blocks(blocks)

    def page_counts(self) -> np.ndarray:
        """``[layers, heads]`` sub-pages each head holds (its length over the block size, rounded up)."""
        return -(-self.lengths // self.block_size)

    def add_blocks(self, blocks: list[int]) -> None:
        """Take ownership of new blocks (appended by vLLM's scheduler): their ``H`` sub-pages become free."""
        for b in blocks:
            self.blocks.append(int(b))
            for free in self.free:
                free.extend(int(b) * self.kv_heads + j for j in range(self.kv_heads))

    def sync_blocks(self, blocks: list[int]) -> None:
        """Adopt the blocks of ``blocks`` (the request's full block list) past those already owned."""
        if blocks[: len(self.blocks)] != self.blocks:
            raise SubPageError(f"the request's block list {blocks} no longer starts with its own blocks {self.blocks}")
        self.add_blocks(blocks[len(self.blocks) :])

    def place(self, layer: int, counts: np.ndarray) -> list[np.ndarray]:
        """Give each head of ``layer`` the sub-pages for ``counts[h]`` kept entries; their slots, per head.

        Returns:
            ``[kv_heads]`` arrays of ``counts[h]`` slots (``sub_page·block_size + offset``) in entry order
        """
        if self.placed[layer]:
            raise SubPageError(f"layer {layer} already holds its kept entries")
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.kv_heads,) or bool((counts < 0).any()):
            raise SubPageError(f"counts must be {self.kv_heads} non-negative integers, got {counts.tolist()}")
        self.placed[layer] = True
        return [self._grow(layer, h, int(n)) for h, n in enumerate(counts)]

    def append(self, layer: int, n: int) -> np.ndarray:
        """Slots ``[n, kv_heads]`` for the next ``n`` entries of every head of ``layer`` (lengths grow by ``n``)."""
        out = np.empty((n, self.kv_heads), dtype=np.int64)
        for h in range(self.kv_heads):
            out[:, h] = self._grow(layer, h, n)
        return out

    def append_all(self, n: int) -> np.ndarray:
        """Slots ``[layers, n, kv_heads]`` for the next ``n`` entries of every head of every layer: what
        :meth:`append` gives layer by layer, with the pages taken in the same order, in one pass over the array."""
        bs = self.block_size
        start = self.lengths
        need = -(-(start + n) // bs) - self.page_counts()  # [layers, heads] new sub-pages
        short = need.sum(-1) > np.array([len(f) for f in self.free])
        if bool(short.any()):
            layer = int(np.flatnonzero(short)[0])
            raise SubPageError(
                f"layer {layer} needs {int(need[layer].sum())} more sub-pages for {n} entries per head, the request "
                f"has {len(self.free[layer])} free of {len(self.blocks) * self.kv_heads}"
            )
        for layer, head in zip(*np.nonzero(need), strict=True):  # layer by layer, heads in order (as append)
            self._take(int(layer), int(head), int(need[layer, head]))
        pos = start[:, :, None] + np.arange(n)  # [layers, heads, n]
        slots = np.take_along_axis(self.page_ids, pos // bs, axis=2) * bs + pos % bs
        self.lengths = start + n
        return np.ascontiguousarray(slots.transpose(0, 2, 1))

    def _take(self, layer: int, head: int, k: int) -> None:
        """Give ``head`` of ``layer`` the next ``k`` free sub-pages of the layer (in block order)."""
        have = -(-int(self.lengths[layer, head]) // self.block_size)
        if have + k > self.page_ids.shape[-1]:
            grown = np.zeros((*self.page_ids.shape[:2], max(2 * self.page_ids.shape[-1], have + k)), np.int64)
            grown[..., : self.page_ids.shape[-1]] = self.page_ids
            self.page_ids = grown
        free = self.free[layer]
        self.page_ids[layer, head, have : have + k] = free[:k]
        del free[:k]

    def _grow(self, layer: int, head: int, n: int) -> np.ndarray:
        bs = self.block_size
        length = int(self.lengths[layer, head])
        need = -(-(length + n) // bs) - -(-length // bs)
        if need > len(self.free[layer]):
            raise SubPageError(
                f"layer {layer} head {head} needs {need} more sub-pages for {n} entries, the request has "
                f"{len(self.free[layer])} free of {len(self.blocks) * self.kv_heads}"
            )
        self._take(layer, head, need)
        self.lengths[layer, head] = length + n
        return self._slots_at(layer, head, np.arange(length, length + n))

    def slots(self, layer: int, head: int) -> np.ndarray:
        """``[length]`` one-head slots of the entries ``head`` holds in ``layer``, in entry order."""
        return self._slots_at(layer, head, np.arange(int(self.lengths[layer, head])))

    def _slots_at(self, layer: int, head: int, pos: np.ndarray) -> np.ndarray:
        """One-head slots (``sub_page·block_size + offset``) of the entries at ``pos`` of a head's pages."""
        bs = self.block_size
        return self.page_ids[layer, head][pos // bs] * bs + pos % bs

    def restart_layer(self, layer: int, num_blocks: int) -> None:
        """Empty ``layer``: no head holds a page, the sub-pages of the first ``num_blocks`` blocks are free (a
        round re-places the layer's kept entries there; the caller has read them first)."""
        if not 0 <= num_blocks <= len(self.blocks):
            raise SubPageError(f"cannot restart layer {layer} on {num_blocks} of {len(self.blocks)} blocks")
        self.free[layer] = [b * self.kv_heads + j for b in self.blocks[:num_blocks] for j in range(self.kv_heads)]
        self.lengths[layer] = 0
        self.placed[layer] = False

    def truncate_blocks(self, num_blocks: int) -> None:
        """Give up every block past the first ``num_blocks`` (vLLM's scheduler freed them after a round); every
        layer must have been restarted on at most that many."""
        keep = set(self.blocks[:num_blocks])
        for layer in range(self.num_layers):
            held = [p for pages in self.table(layer) for p in pages] + self.free[layer]
            if any(s // self.kv_heads not in keep for s in held):
                raise SubPageError(f"layer {layer} still uses a sub-page of a block past the first {num_blocks}")
        del self.blocks[num_blocks:]
        self.check()

    def table(self, layer: int) -> list[list[int]]:
        """Each head's sub-page ids of ``layer``, in entry order."""
        counts = self.page_counts()[layer]
        return [self.page_ids[layer, h, : counts[h]].tolist() for h in range(self.kv_heads)]

    def check(self) -> None:
        """Raise :class:`SubPageError` unless the invariants hold in every layer.

        No sub-page is used twice or both used and free; every used or free sub-page belongs to an owned block;
        used + free = all owned sub-pages (each head uses the pages that cover its length).
        """
        owned = {b * self.kv_heads + j for b in self.blocks for j in range(self.kv_heads)}
        for layer in range(self.num_layers):
            used = [p for pages in self.table(layer) for p in pages]
            both = used + self.free[layer]
            if len(set(both)) != len(both):
                raise SubPageError(f"layer {layer}: a sub-page is used twice or both used and free")
            if set(both) != owned:
                raise SubPageError(f"layer {layer}: used + free sub-pages differ from the owned blocks' sub-pages")
