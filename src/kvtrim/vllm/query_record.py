"""The worker's record of a request's recent queries in one layer (the observation window of a later round).

vLLM hands each step's queries to the attention call in a buffer it reuses, so a round that runs at a later step
(a decoding round, or a chunk's round of a method observing more queries than the chunk held) reads copies the
worker made. The record keeps the newest ``window`` rows; appending copies only the new rows into a buffer of
its own (twice the window, or grown by doubling when the window is every prompt query), and moves the kept rows to
the buffer's front once it is full, so a step costs about its own rows whatever the window (concatenating the
held rows with the new ones every step copied the whole window each time, and every prompt query held so far
every chunk for KVC-full).
"""

from __future__ import annotations

import torch

__all__ = ["QueryRecord"]

_BOUNDED = 1024  # windows up to this many rows get a buffer of twice the window at once; longer ones grow


class QueryRecord:
    """The newest ``window`` query rows ``[n, q_heads, head_dim]`` of one request in one layer, oldest first."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._buf: torch.Tensor | None = None
        self._start = 0  # first live row
        self._end = 0  # one past the newest row

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def rows(self) -> torch.Tensor:
        """The recorded rows, oldest first (a view: read it before the next :meth:`append`)."""
        if self._buf is None:
            raise RuntimeError("kvtrim: no query recorded")
        return self._buf[self._start : self._end]

    def append(self, new: torch.Tensor) -> None:
        """Record ``new`` ``[k, q_heads, head_dim]`` after the held rows, keeping the newest ``window``."""
        new = new[max(new.shape[0] - self.window, 0) :]
        k = new.shape[0]
        if self._buf is None:
            rows = 2 * self.window if self.window <= _BOUNDED else max(2 * k, 256)
            self._buf = torch.empty((rows, *new.shape[1:]), dtype=new.dtype, device=new.device)
        if self._end + k > self._buf.shape[0]:
            keep = min(len(self), self.window - k)  # held rows still among the newest window after this append
            held = self._buf[self._end - keep : self._end].clone()
            if keep + k > self._buf.shape[0]:  # an unbounded window (every query) outgrew the buffer: double it
                rows = max(2 * self._buf.shape[0], keep + k)
                self._buf = torch.empty((rows, *new.shape[1:]), dtype=new.dtype, device=new.device)
            self._buf[:keep].copy_(held)
            self._start, self._end = 0, keep
        self._buf[self._end : self._end + k].copy_(new)
        self._end += k
        self._start = max(self._start, self._end - self.window)
