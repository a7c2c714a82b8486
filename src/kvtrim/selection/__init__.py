"""Selectors: which entries each (row, KV head) keeps under its budget."""
