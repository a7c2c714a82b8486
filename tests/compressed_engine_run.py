"""One engine run shared by the decode-kernel and CUDA-graph tests: random-text prompts through an Engine at
compression rate 4 (continual metric on), to completion, with no block leaked."""

from __future__ import annotations

from conftest import random_text
from kvtrim.serve.engine import Engine
from kvtrim.serve.types import SamplingParams


def run_compressed(
    model, tok, *, requests: int, max_tokens: int, kv_blocks: int = 96, length_step: int = 7, **options
) -> tuple[list[list[int]], Engine]:
    """Prompts of ``90 + length_step * i`` bytes, ``max_tokens`` each (EOS ignored); ``options`` go to the Engine.
    Returns the token ids per request and the engine."""
    engine = Engine(
        model, tok, kv_blocks=kv_blocks, block_size=16, compression_rate=4.0, min_cache_tokens=16, protected_window=8,
        **options,
    )  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    handles = [engine.submit(random_text(90 + length_step * i, seed=i), params) for i in range(requests)]
    engine.run_until_idle()
    assert engine.pool.num_free == engine.pool.num_blocks
    results = [h.result(timeout=0) for h in handles]
    failed = [r.error for r in results if r.finish_reason == "error"]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[0]}"  # not a token mismatch later
    return [r.token_ids for r in results], engine
