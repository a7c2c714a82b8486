"""Serving: a continuous-batching engine over a paged, compressed KV cache, and an OpenAI-compatible server.

The engine needs only torch; the HTTP server (:mod:`kvtrim.serve.http`) needs the ``serve`` extra (FastAPI, uvicorn).
"""

from .engine import Engine, EngineStats
from .types import RequestHandle, RequestOutput, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineStats", "RequestHandle", "RequestOutput", "SamplingParams", "TokenEvent"]
