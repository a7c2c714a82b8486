"""Scorers: how much each stored entry matters (``Scorer.score(view) -> [batch, kv_heads, seq]``)."""
