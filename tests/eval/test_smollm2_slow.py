"""Length fitting with the real SmolLM2 tokenizer (slow: needs the provisioned embedded model)."""

from __future__ import annotations

import pytest

from kvtrim.eval.tasks import generate_task
from kvtrim.eval.tasks.base import TokenCounter, length_tolerance

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_tokenizer():
    models = pytest.importorskip("kvtrim.models")
    if not hasattr(models, "load_tokenizer"):
        pytest.skip("kvtrim.models.load_tokenizer is not available")
    return models.load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_1", "vt", "cwe", "fwe", "passkey"])
def test_real_tokenizer_lengths(smol_tokenizer, jargon_text, name: str) -> None:
    counter = TokenCounter(smol_tokenizer)
    for sample in generate_task(name, smol_tokenizer, 4096, 2, seed=42):
        total = counter.count(sample.context + sample.question + sample.answer_prefix) + sample.max_new_tokens
        assert 4096 - length_tolerance(4096) <= total <= 4096
        assert all(answer in sample.context for answer in sample.answers) or name in {"cwe", "fwe", "vt"}
