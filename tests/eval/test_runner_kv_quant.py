"""``run_sweep(kv_quant=...)``: every config of the sweep holds quantized entries; one format per directory."""

from __future__ import annotations

import pytest

from conftest import byte_tokenizer, tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.eval.runner import load_records, run_sweep


def _sweep(out, kv_quant):
    return run_sweep(
        (tiny_model("llama"), byte_tokenizer()), ["passkey"], ["snapkv"], [0.5], length=400, samples=1,
        out_dir=out, max_new_tokens=2, progress=False, model_label="tiny-llama", kv_quant=kv_quant,
    )  # fmt: skip


def test_sweep_records_the_format_and_holds_fewer_bytes(tmp_path):
    plain = {r["method"]: r for r in load_records(_sweep(tmp_path / "plain", None))}
    quant = {r["method"]: r for r in load_records(_sweep(tmp_path / "int8", "int8"))}
    assert set(quant) == {"full", "snapkv"}
    for method, record in quant.items():
        assert record["kv_quant"] == "int8" and plain[method]["kv_quant"] is None
        assert record["kv_entries_after"] == plain[method]["kv_entries_after"]
        assert record["kv_bytes_after"] < plain[method]["kv_bytes_after"]
    with pytest.raises(InvalidParameterError, match="kv_quant='int8', this one has kv_quant='int4'"):
        _sweep(tmp_path / "int8", "int4")
    with pytest.raises(InvalidParameterError, match="kv_quant must be one of"):
        _sweep(tmp_path / "bad", "int2")
