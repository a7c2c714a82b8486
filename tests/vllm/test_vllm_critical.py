"""CriticalKV inside vLLM: on AdaKV's per-head budgets (one-head sub-pages) and on uniform budgets."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import LAYERS, LENGTHS, check_tokens_and_blocks
from vllm_helpers import token_prompts, truncated_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("critical") / "smollm2-4layers", layers=LAYERS)


@pytest.mark.parametrize("method", ["critical_adakv", "critical_snapkv"])
def test_criticalkv_tokens_equal_the_transformers_path(model, method):
    """The second stage reads o_proj, which vLLM's CPU linear packs away (read back through the layer's GEMM)."""
    check_tokens_and_blocks(model, token_prompts(LENGTHS), method)
