"""Serving: a continuous-batching engine over a paged, compressed KV cache, and an OpenAI-compatible server."""
