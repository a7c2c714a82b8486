"""benchmarks/bench_kvquant_regroup.py on the tiny random Llama: the copy of a prefill whose kept keys are quantized
once is closer to the float keys than the one quantized from its codes, with the same kept entries."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvtrim.cache.quant import resolve_kv_quant
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.runtime import Prefill, observation_of, resolve_method
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_kvquant_regroup.py")


@pytest.mark.parametrize("method", ["snapkv", "adakv"])  # a dense and a ragged (per-head) store
def test_quantized_once_is_closer_than_from_the_codes(bench, method):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids, cont = torch.randint(5, 250, (1, 300), generator=g), torch.randint(5, 250, (1, 9), generator=g)
    pipeline, spec = resolve_method(method, 0.75, None, None, model)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ids, torch.ones_like(ids), observation_of([pipeline]))
        row = bench.compare_row(model, pre, pipeline, spec, resolve_kv_quant("int4:residual=0"), cont)
        assert bench.key_error(pre.compressed(None, None).cache, pre.cache) == 0.0  # the float keys themselves
        full = bench.compare_row(model, pre, None, None, resolve_kv_quant("int4:residual=0"), cont)
    assert row["same_kept"]
    assert 0 < row["key_error_once"] < row["key_error_codes"]
    assert row["kl_once"] >= 0 and row["kl_codes"] > 0
    # nothing evicted: no compaction, both copies are the same
    assert full["key_error_once"] == full["key_error_codes"] > 0 and full["kl_once"] == full["kl_codes"]


def test_table(bench):
    s = {"method": "kvzip", "ratio": 0.5, "prompts": 10, "key_error_once": 0.0362, "key_error_codes": 0.0471,
         "kl_once": 0.0051, "kl_codes": 0.0102, "same_kept": 10}  # fmt: skip
    md = bench.render([s], {"kv_quant": "int4", "resolved": "int4:group_size=32,residual=32,sink=0", "prompts": 10,
                            "samples": 2, "seed": 42, "length": 1024})  # fmt: skip
    assert "| kvzip | 0.5 | 0.0362 | 0.0471 | 0.00510 | 0.01020 | 10/10 |" in md
