"""Lag partitions: the recursive frame LagKV scores and selects in.

After ``sink`` tokens and the part already compressed, the uncompressed tokens of a row are cut into partitions
of ``lag`` tokens. With ``n`` full partitions, partitions ``0 … n−2`` are compressed now; the last full partition
and the remainder form the uncompressed tail (the next round's reference). Everything is in logical positions, so
the frame survives eviction, padding and ragged storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PartitionLayout:
    """Where each stored slot sits in the lag frame of its row.

    Attributes:
        part: ``[batch, kv_heads, seq]`` full-partition index of the slot, ``-1`` outside the full partitions
            (sink, already compressed, remainder, empty slots)
        offset: ``[batch, kv_heads, seq]`` offset inside the partition (meaningful where ``part >= 0``)
        start: ``[batch]`` first uncompressed position (the sink size before the first compression)
        full: ``[batch]`` number of full partitions ``n``
        compress: ``[batch]`` partitions compressed now, ``max(n − 1, 0)``
        lag: partition length ``L``
    """

    part: torch.Tensor
    offset: torch.Tensor
    start: torch.Tensor
    full: torch.Tensor
    compress: torch.Tensor
    lag: int

    @property
    def compressible(self) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` True for slots inside a partition compressed now."""
        return (self.part >= 0) & (self.part < self.compress.view(-1, 1, 1))

    @property
    def new_start(self) -> torch.Tensor:
        """``[batch]`` first uncompressed position after this round."""
        return self.start + self.compress * self.lag

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Arrange ``x`` ``[batch, kv_heads, seq, d]`` as ``[batch, kv_heads, P, lag, d]`` full partitions
        (``P`` = the largest ``n`` over rows; partitions a row does not have are zeros)."""
        b, h, _, d = x.shape
        p = int(self.full.max()) if self.full.numel() else 0
        dump = p * self.lag
        index = torch.where(self.part >= 0, self.part * self.lag + self.offset, dump)
        buf = x.new_zeros(b, h, dump + 1, d)
        buf.scatter_(2, index.unsqueeze(-1).expand(-1, -1, -1, d), x)
        return buf[:, :, :dump].view(b, h, p, self.lag, d)

    def scatter_back(self, per_partition: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Read ``[batch, kv_heads, P', lag]`` values back per slot; slots not compressed now get ``fill``."""
        b, h, p, lag = per_partition.shape
        flat = per_partition.reshape(b, h, p * lag)
        mask = self.compressible
        index = torch.where(mask, self.part * lag + self.offset, 0).clamp(max=max(p * lag - 1, 0))
        if p == 0:
            return torch.full(self.part.shape, fill, dtype=per_partition.dtype, device=per_partition.device)
        return torch.gather(flat, 2, index).masked_fill(~mask, fill)


def partition_layout(
    positions: torch.Tensor,
    context_lengths: torch.Tensor,
    compressed_until: torch.Tensor | None,
    sink: int,
    lag: int,
) -> PartitionLayout:
    """The lag frame of every slot.

    Args:
        positions: ``[batch, kv_heads, seq]`` logical positions, ``-1`` for empty slots
        context_lengths: ``[batch]`` tokens seen per row
        compressed_until: ``[batch]`` first position not yet compressed, or None before the first round
            (then the sink size)
    """
    device = positions.device
    context = context_lengths.to(device).long()
    start = torch.full_like(context, sink) if compressed_until is None else compressed_until.to(device).long()
    full = ((context - start).clamp(min=0)) // lag
    compress = (full - 1).clamp(min=0)
    rel = positions - start.view(-1, 1, 1)
    inside = (positions >= 0) & (rel >= 0) & (rel < (full * lag).view(-1, 1, 1))
    part = torch.where(inside, rel // lag, -1)
    offset = torch.where(inside, rel % lag, 0)
    return PartitionLayout(part=part, offset=offset, start=start, full=full, compress=compress, lag=lag)


def kept_length(total: int, sink: int, lag: int, keep_per_partition: int) -> int:
    """Entries LagKV keeps of a ``total``-token sequence compressed in one pass (the paper's eq. 12):
    ``S + (n − 1)·⌊rL⌋ + L + rem`` with ``n = ⌊(T − S)/L⌋`` full partitions, or everything when ``n < 2``."""
    if total - sink < 2 * lag:
        return total
    n, rem = divmod(total - sink, lag)
    return sink + (n - 1) * keep_per_partition + lag + rem
