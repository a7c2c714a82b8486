"""benchmarks/bench_kvquant_noise_floor.py: which prompts a format changed, rounding a float cache's kept entries,
and one answer with rounded or quantized entries, on hand-made records and a tiny random model."""

from __future__ import annotations

import pytest
import torch

from conftest import byte_tokenizer, random_text, tiny_model
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_kvquant_noise_floor.py")


def _rec(task, index, score, method="kvzip", ratio=0.875, seed=42, mode="context-only"):
    return {"task": task, "index": index, "seed": seed, "length": 1024, "method": method, "ratio": ratio,
            "mode": mode, "score": score, "meta": {"i": index}}  # fmt: skip


def test_changed_cases_are_the_prompts_whose_score_moved(bench):
    base = [_rec("passkey", 4, 1.0), _rec("passkey", 5, 0.0), _rec("vt", 0, 0.6), _rec("vt", 1, 1.0, ratio=0.5),
            _rec("fwe", 2, 1.0, mode="question-aware"), _rec("fwe", 3, 1.0, method="snapkv")]  # fmt: skip
    other = [_rec("passkey", 4, 0.0), _rec("passkey", 5, 0.0), _rec("vt", 0, 0.4), _rec("vt", 1, 0.0, ratio=0.5),
             _rec("fwe", 2, 0.0, mode="question-aware"), _rec("fwe", 3, 0.0, method="snapkv"),
             _rec("niah_single_2", 0, 1.0)]  # fmt: skip
    cases = bench.changed_cases(base, other, "kvzip", 0.875)
    assert [(c["task"], c["index"], c["baseline"], c["other"]) for c in cases] == [
        ("passkey", 4, 1.0, 0.0), ("vt", 0, 0.6, 0.4)
    ]  # fmt: skip
    assert cases[0]["meta"] == {"i": 4}
    assert bench.changed_cases(base, base, "kvzip", 0.875) == []


@pytest.mark.parametrize("method", ["snapkv", "adakv"])  # a dense and a ragged (per-head) store
def test_rounding_the_kept_entries_rounds_every_layers_store(bench, method):
    import kvtrim

    model, tok = tiny_model(), byte_tokenizer()
    ids = tok(random_text(120), return_tensors="pt").input_ids
    cache = kvtrim.make_cache(model, method, budget=40)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    before = [(layer.store._k.clone(), layer.store._v.clone()) for layer in cache.kv_layers]
    n = bench.round_kept_entries(cache, torch.bfloat16)
    assert n == sum(layer.store.entries() for layer in cache.kv_layers) > 0
    for (k, v), layer in zip(before, cache.kv_layers, strict=True):
        assert torch.equal(layer.store._k, k.to(torch.bfloat16).float())
        assert torch.equal(layer.store._v, v.to(torch.bfloat16).float())
        assert not torch.equal(layer.store._k, k)  # float32 keys of a random model do change in bfloat16


def test_answers_with_rounded_and_quantized_entries_leave_the_session_as_it_was(bench):
    from kvtrim.api import Session, resolve_method
    from kvtrim.cache.quant import resolve_kv_quant
    from kvtrim.eval.tasks.base import Sample

    model, tok = tiny_model(), byte_tokenizer()
    sample = Sample(task="t", context=random_text(200), question="what?", answer_prefix="", answers=["x"],
                    metric="string_match_all", max_new_tokens=6, index=0, seed=0)  # fmt: skip
    session = Session(model, tok, sample.context, methods=["snapkv"], use_chat_template=False)
    plain = bench.answer(session, sample, "snapkv", 0.75, None, None)
    assert "compressed" not in vars(session.prefill)  # the rounding hook is removed after each answer
    assert bench.answer(session, sample, "snapkv", 0.75, torch.float16, None) is not None
    assert bench.answer(session, sample, "snapkv", 0.75, None, "int8") is not None
    assert bench.answer(session, sample, "snapkv", 0.75, None, None) == plain
    pipeline, spec = resolve_method("snapkv", 0.75, None, None, model)
    quantized = session.prefill.compressed(pipeline, spec, resolve_kv_quant("int8"))
    with pytest.raises(ValueError, match="no float entries"):
        bench.round_kept_entries(quantized.cache, torch.float16)


def test_the_table_says_which_rounding_flips_a_prompt_too(bench):
    report = {"format": "int8", "method": "kvzip", "ratio": 0.875, "date": "d", "command": "c", "baseline": "none",
              "cases": [{"task": "passkey", "index": 4, "seed": 42, "baseline": 1.0, "other": 0.0,
                         "scores": {"float32": 1.0, "bfloat16": 1.0, "float16": 0.0, "int8": 0.0}},
                        {"task": "vt", "index": 0, "seed": 11, "baseline": 0.6, "other": 0.4,
                         "scores": {"float32": 0.6, "bfloat16": 0.6, "float16": 0.6, "int8": 0.4}}]}  # fmt: skip
    rows = [line for line in bench.render(report) if line.startswith("| passkey") or line.startswith("| vt")]
    assert rows[0].endswith("| 1.00 | 1.00 | 0.00 | 0.00 | float16 |")
    assert rows[1].endswith("| 0.60 | 0.60 | 0.60 | 0.40 | no |")
