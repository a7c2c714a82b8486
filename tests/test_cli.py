"""The kvtrim command line (on a tiny model saved to disk)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.cli import app

runner = CliRunner()
JSON_KEYS = {
    "answer",
    "method",
    "ratio",
    "budget",
    "context_tokens",
    "kv_entries_before",
    "kv_entries_after",
    "kv_bytes_before",
    "kv_bytes_after",
    "prefill_s",
    "compress_s",
    "decode_ms_per_token",
}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def context_file(tmp_path):
    f = tmp_path / "ctx.txt"
    f.write_text(random_text(150, seed=3))
    return f


def test_methods_lists_registry():
    out = runner.invoke(app, ["methods"])
    assert out.exit_code == 0
    for name in ["snapkv", "h2o", "streaming_llm", "arXiv 2404.14469"]:
        assert name in out.output


def test_generate_json_has_documented_keys(saved_model, context_file):
    out = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(saved_model),
            "--method",
            "snapkv",
            "--ratio",
            "0.5",
            "--context-file",
            str(context_file),
            "--question",
            "what?",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(payload) >= JSON_KEYS
    assert payload["context_tokens"] == 150
    assert payload["kv_entries_after"] == payload["kv_entries_before"] // 2


def test_generate_text_output(saved_model, context_file):
    out = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(saved_model),
            "--method",
            "knorm",
            "--budget",
            "40",
            "--context-file",
            str(context_file),
            "--question",
            "a?",
            "--question",
            "b?",
            "--max-new-tokens",
            "3",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "Q: a?" in out.output and "Q: b?" in out.output and "MiB" in out.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ratio", "1.5"], "ratio must be in [0, 1)"),
        (["--budget", "0"], "budget must be a positive integer"),
        (["--method", "nope", "--ratio", "0.5"], "valid methods"),
        (["--ratio", "0.5", "--context-file", "/nonexistent/file.txt"], "does not exist"),
    ],
)
def test_generate_errors(saved_model, context_file, args, message):
    base = ["generate", "--model", str(saved_model), "--context-file", str(context_file), "--question", "q"]
    out = runner.invoke(app, base + args)
    assert out.exit_code == 2
    assert message in out.output


def test_models_list():
    out = runner.invoke(app, ["models", "list"])
    assert out.exit_code == 0 and "smollm2-135m" in out.output
