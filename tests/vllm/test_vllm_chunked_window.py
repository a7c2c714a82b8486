"""A prompt prefilled in several steps is scored with its whole observation window, not the last step's rows."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import BLOCK, LAYERS, generate, transformers_tokens, worker_state
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

pytestmark = pytest.mark.slow

STEP = 128  # max_num_batched_tokens: a 260-token prompt runs as 128 + 128 + 4 rows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("window") / "smollm2-4layers", layers=LAYERS)


@pytest.mark.parametrize(
    ("method", "params", "lengths"),
    [
        ("snapkv", {}, [260, 390]),  # the last step holds 4 and 6 rows of SnapKV's 8-query window
        ("adakv", {}, [260]),  # per-head sub-pages, same window
        ("kvc_full", {"even_layer_evict": True}, [300]),  # KVC-full observes every prompt query
    ],
)
def test_last_prefill_step_smaller_than_the_window_equals_the_transformers_path(model, method, params, lengths):
    prompts = token_prompts(lengths, seed=21)
    config = {"method": method, "budget": 64, "params": params}
    llm = make_llm(config, model=str(model), block_size=BLOCK, max_num_batched_tokens=STEP, max_num_seqs=1)
    try:
        out = generate(llm, prompts, 16)
        assert scheduler(llm)._kvtrim_state.requests_compressed == len(prompts)
        worker = worker_state(llm)
        assert worker.recent == {} and used_blocks(llm) == 0  # the recorded queries are released
    finally:
        close(llm)
    assert out == transformers_tokens(model, prompts, method, 16, params)
