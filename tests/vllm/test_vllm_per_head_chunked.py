"""AdaKV inside vLLM under chunked prefill: per-head requests decode in the same steps as other prompts' chunks."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import BLOCK, BUDGET, LAYERS, generate, transformers_tokens, worker_state
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("chunked") / "smollm2-4layers", layers=LAYERS)


def test_adakv_with_chunked_prefill_and_mixed_steps_equals_the_transformers_path(model, monkeypatch):
    """128-token steps: the 300-token prompt is compressed and decodes while the 700-token one still prefills."""
    from kvtrim.vllm import head_backend

    chunk_rows = []  # per folded attention call: the longest query of a request (> 1: a prompt chunk)
    orig = head_backend.folded_attention

    def recording(query, kv_cache, output, query_start_loc, *args, **kwargs):
        chunk_rows.append(int((query_start_loc[1:] - query_start_loc[:-1]).max()))
        return orig(query, kv_cache, output, query_start_loc, *args, **kwargs)

    monkeypatch.setattr(head_backend, "folded_attention", recording)
    prompts = token_prompts([300, 700], seed=12)
    llm = make_llm(
        {"method": "adakv", "budget": BUDGET}, model=str(model), block_size=BLOCK, max_num_batched_tokens=128
    )
    try:
        out = generate(llm, prompts, 16)
        assert scheduler(llm)._kvtrim_state.requests_compressed == 2
        assert worker_state(llm).ragged_layers == 2 * LAYERS and used_blocks(llm) == 0
    finally:
        close(llm)
    # folded steps in which the compressed request decodes next to the other prompt's chunks (4 layers each)
    assert sum(n > 1 for n in chunk_rows) >= 2 * LAYERS
    assert out == transformers_tokens(model, prompts, "adakv", 16)
