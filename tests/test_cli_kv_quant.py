"""``kvtrim generate --kv-quant`` (on a tiny model saved to disk)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def context_file(tmp_path):
    f = tmp_path / "ctx.txt"
    f.write_text(random_text(300, seed=3))
    return f


def _generate(saved_model, context_file, *extra):
    base = ["generate", "--model", str(saved_model), "--context-file", str(context_file), "--question", "q?"]
    return runner.invoke(app, [*base, "--ratio", "0.5", "--max-new-tokens", "2", *extra])


def test_kv_quant_holds_fewer_bytes_for_the_same_entries(saved_model, context_file):
    plain = _generate(saved_model, context_file, "--json")
    int4 = _generate(saved_model, context_file, "--json", "--kv-quant", "int4")
    assert plain.exit_code == 0 and int4.exit_code == 0, int4.output
    p, q = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, int4))
    assert q["kv_quant"] == "int4:group_size=64,residual=32,sink=1,rotate=1"  # every setting resolved
    assert p["kv_quant"] is None
    assert q["kv_entries_after"] == p["kv_entries_after"] and q["kv_bytes_after"] < p["kv_bytes_after"]
    text = _generate(saved_model, context_file, "--kv-quant", "int8")
    assert text.exit_code == 0 and "kv_quant=int8:group_size=64,residual=0,sink=0,rotate=0]" in text.output
    packed = _generate(saved_model, context_file, "--json", "--kv-quant", "int4:residual=0")
    assert packed.exit_code == 0, packed.output
    r = json.loads(packed.stdout.strip().splitlines()[-1])
    assert r["kv_quant"] == "int4:group_size=64,residual=0,sink=1,rotate=1"
    assert r["kv_bytes_after"] < q["kv_bytes_after"]


def test_bad_kv_quant_is_refused_before_loading(saved_model, context_file):
    out = _generate(saved_model, context_file, "--kv-quant", "fp4")
    assert out.exit_code == 2
    assert "kv_quant must be one of ('int8', 'int4', 'fp8') or None, got 'fp4'" in out.output


def test_think_takes_kv_quant_on_the_command_line(saved_model, context_file):
    plain = _generate(saved_model, context_file, "--json", "--method", "think")
    fp8 = _generate(saved_model, context_file, "--json", "--method", "think", "--kv-quant", "fp8")
    assert plain.exit_code == 0 and fp8.exit_code == 0, fp8.output
    p, q = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, fp8))
    assert q["kv_quant"] == "fp8:group_size=64,residual=0,sink=0,rotate=0"
    assert q["kv_entries_after"] == p["kv_entries_after"] and q["kv_bytes_after"] < p["kv_bytes_after"] / 2
    int4 = _generate(saved_model, context_file, "--json", "--method", "think", "--kv-quant", "int4")  # rotated
    assert int4.exit_code == 0, int4.output
    r = json.loads(int4.stdout.strip().splitlines()[-1])
    assert r["kv_quant"].endswith("rotate=1") and r["kv_entries_after"] == p["kv_entries_after"]
