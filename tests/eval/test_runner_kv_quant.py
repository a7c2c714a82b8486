"""``run_sweep(kv_quant=...)``: every config of the sweep holds quantized entries; one format per directory."""

from __future__ import annotations

import json

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
        assert record["kv_quant"] == "int8:group_size=64,residual=0,sink=0,rotate=0"
        assert plain[method]["kv_quant"] is None
        assert record["kv_entries_after"] == plain[method]["kv_entries_after"]
        assert record["kv_bytes_after"] < plain[method]["kv_bytes_after"]
    with pytest.raises(
        InvalidParameterError,
        match="kv_quant='int8:group_size=64,residual=0,sink=0,rotate=0', this one has "
        "kv_quant='int4:group_size=64,residual=32,sink=1,rotate=1'",
    ):
        _sweep(tmp_path / "int8", "int4")
    with pytest.raises(InvalidParameterError, match="kv_quant must be one of"):
        _sweep(tmp_path / "bad", "int2")


def test_run_json_names_every_resolved_setting_and_a_change_of_default_is_refused(tmp_path):
    """``"int4"`` is recorded as ``int4:group_size=64,residual=32,sink=1,rotate=1``; the same spelled out resumes
    the directory, and a directory whose run.json names ``"int4"`` as given (before the settings were resolved:
    groups of 32, no window, no sink, no rotation then) is not resumed with today's default."""
    out = tmp_path / "int4"
    _sweep(out, "int4")
    run = json.loads((out / "run.json").read_text())
    today = "int4:group_size=64,residual=32,sink=1,rotate=1"
    assert [r["kv_quant"] for r in run["runs"]] == [today]
    assert {r["kv_quant"] for r in load_records(out)} == {today}
    _sweep(out, "int4:rotate=1,residual=32,group_size=64,sink=1")  # the same setting: resumes, nothing to add
    assert len(json.loads((out / "run.json").read_text())["runs"]) == 2
    other = "int4:group_size=64,residual=32,sink=1,rotate=0"
    with pytest.raises(InvalidParameterError, match=f"kv_quant='{today}', this one has kv_quant='{other}'"):
        _sweep(out, "int4:rotate=0")
    legacy = tmp_path / "legacy"
    _sweep(legacy, "int4:group_size=32,residual=0,sink=0,rotate=0")
    data = json.loads((legacy / "run.json").read_text())
    data["runs"][0]["kv_quant"] = "int4"  # as written before the settings were resolved
    (legacy / "run.json").write_text(json.dumps(data))
    with pytest.raises(InvalidParameterError, match="kv_quant='int4', this one has"):
        _sweep(legacy, "int4")
    _sweep(legacy, "int4:group_size=32,residual=0,sink=0,rotate=0")  # what "int4" meant when it was written
    assert len(json.loads((legacy / "run.json").read_text())["runs"]) == 2


def test_a_legacy_name_resumes_with_the_setting_it_meant(tmp_path):
    """Before every setting was spelled out, no format had a window (nor a sink, nor rotation) and int4's key
    groups held 32 tokens: ``"int8"`` then is ``int8`` now, ``"int4:residual=32"`` then is
    ``int4:group_size=32,sink=0,rotate=0`` now, a spec written before the sink existed meant none, and one written
    before rotation existed (with every other setting spelled out) meant no rotation."""
    for i, (given, written, today) in enumerate((
        ("int8", "int8", "int8"),
        ("int4:group_size=32,sink=0,rotate=0", "int4:residual=32", "int4:group_size=32,sink=0,rotate=0"),
        ("int4:group_size=32,sink=0,rotate=0", "int4:group_size=32,residual=32", "int4:group_size=32,sink=0,rotate=0"),
        ("int4:sink=1,rotate=0", "int4:group_size=64,residual=32,sink=1", "int4:sink=1,rotate=0"),
    )):
        out = tmp_path / str(i)
        _sweep(out, given)
        data = json.loads((out / "run.json").read_text())
        data["runs"][0]["kv_quant"] = written
        (out / "run.json").write_text(json.dumps(data))
        _sweep(out, today)
        assert len(json.loads((out / "run.json").read_text())["runs"]) == 2
