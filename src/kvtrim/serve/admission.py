"""Block arithmetic of admission: what a request is projected to hold, and the most it can ever need.

Pure arithmetic over the pool's :class:`~kvtrim.serve.scheduler.BlockGeometry` and the compression settings; the
engine admits and rejects with it, and each request's committed size (``ScheduledSequence.committed_blocks``)
comes from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scheduler import BlockGeometry, max_cache_tokens


@dataclass(frozen=True)
class KVBudget:
    """The compressed budget of a sequence and the blocks admission counts for it.

    Attributes:
        geometry: the pool's block arithmetic
        compression_rate: cr; 1 keeps everything
        min_cache_tokens: floor of the per-head average budget M
        protected_window: newest tokens of every head never evicted
        compress_once: compressed only once after each prefill (else continually)
    """

    geometry: BlockGeometry
    compression_rate: float
    min_cache_tokens: int
    protected_window: int
    compress_once: bool = False

    @property
    def compress(self) -> bool:
        return self.compression_rate > 1.0

    def max_cache_tokens(self, tokens: int) -> int:
        """The per-head average budget M of a sequence of ``tokens`` tokens."""
        g = self.geometry
        return max_cache_tokens(tokens, self.compression_rate, self.min_cache_tokens, g.block_size)

    def projected_blocks(self, prompt_tokens: int, final_tokens: int) -> int:
        """Blocks admission counts a request for (its ``committed_blocks`` is at least this).

        Without compression: its uncompressed prompt and first token, as vLLM admits (growth is left to preemption).
        With compression the growth is small and bounded, so it is reserved: the compressed budget at
        ``final_tokens`` (prompt + max_tokens) plus one partial block per table.
        """
        g = self.geometry
        if not self.compress:
            return g.blocks_for(prompt_tokens + 1)
        m = self.max_cache_tokens(final_tokens)
        return min(g.blocks_for(final_tokens), g.budget_blocks(max(m, self.protected_window)) + g.tables)

    def blocks_bound(self, prompt_tokens: int, max_tokens: int) -> int:
        """Most blocks a request alone ever needs: its prefill, and its growth (compressed or not) while decoding.

        The last decode step feeds ``prompt_tokens + max_tokens − 1`` tokens. Compressed, a sequence is cut to its
        budget M at the start of each step; it may then still hold up to one more block per table (no head is cut
        below M entries, so block rounding can stay) and grows by at most one block per table before the next one.
        """
        g = self.geometry
        prefill = g.blocks_for(prompt_tokens + 1)  # admission also reserves the first decoded token's blocks
        full = g.blocks_for(prompt_tokens + max_tokens - 1)
        if not self.compress:
            return max(prefill, full)

        def budget(tokens: int) -> int:
            return g.budget_blocks(max(self.max_cache_tokens(tokens), self.protected_window))

        if self.compress_once:
            grown = budget(prompt_tokens) + g.tables * (-(-(max_tokens - 1) // g.block_size) + 2)
        else:
            grown = budget(prompt_tokens + max_tokens - 1) + 2 * g.tables
        return max(prefill, min(full, grown))
