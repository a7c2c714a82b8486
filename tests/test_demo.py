"""``kvtrim demo`` on a tiny model: the layout it states, the context-only winners' rows, CPU-time columns."""

from __future__ import annotations

import math
import shutil

import torch

import kvtrim.demo as demo
from conftest import byte_tokenizer, install_head_scores, tiny_model
from kvtrim.models import kvtrim_home


def test_demo_defaults_include_the_context_only_winners():
    assert {"kvzip", "headkv", "duo_attention"} <= set(demo.DEFAULT_METHODS)


def test_demo_table_on_a_tiny_model(monkeypatch, tmp_path, capsys):
    haystacks = kvtrim_home() / "haystacks"
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    install_head_scores(model, monkeypatch, tmp_path)  # headkv / duo artifacts; KVTRIM_HOME is now tmp_path
    if haystacks.is_dir():
        shutil.copytree(haystacks, tmp_path / "haystacks")
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: (model, tokenizer))
    layouts = []
    session = demo.Session

    def recording_session(*args, **kwargs):
        layouts.append(kwargs["prompt_format"])
        return session(*args, **kwargs)

    monkeypatch.setattr(demo, "Session", recording_session)
    rows = demo.run_demo(samples=1, length=400, ratios=[0.5], methods=["snapkv", "kvzip", "headkv", "duo_attention"])
    out = capsys.readouterr().out
    assert set(layouts) == {"kvpress"} and "kvpress prompt layout" in out
    assert f"{torch.get_num_threads()} torch thread(s)" in out and "process CPU milliseconds" in out
    assert [r["method"] for r in rows] == ["full", "snapkv", "kvzip", "headkv", "duo_attention"]
    for r in rows:  # 4 prompts (2 tasks x 2 modes), the first one left out of the times
        assert math.isfinite(r["decode_ms"]) and r["decode_ms"] > 0
        assert r["compress_ms"] >= 0 and (r["method"] == "full") == (r["compress_ms"] == 0)
    assert rows[0]["kept_pct"] == 100 and all(r["kept_pct"] < 100 for r in rows[1:])
