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


def test_generate_with_schedule_and_chunked_prefill(saved_model, context_file):
    args = ["generate", "--model", str(saved_model), "--method", "snapkv@over:0", "--budget", "40"]
    args += ["--context-file", str(context_file), "--question", "q?", "--max-new-tokens", "30"]
    out = runner.invoke(app, [*args, "--prefill-chunk", "50", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    assert payload["prefill_chunk"] == 50
    assert payload["compressions"] > 1  # between chunks, after the prompt, and while decoding
    per_entry = 2 * 16 * 4  # K and V, head_dim 16, fp32
    assert payload["peak_kv_bytes"] < payload["context_tokens"] * 2 * 2 * per_entry  # never the whole prompt


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
        (["--method", "lagkv", "--budget", "10"], "takes ratio"),
        (["--method", "snapkv@sometimes", "--ratio", "0.5"], "schedule='sometimes' is not understood"),
        (["--method", "snapkv@tail:64", "--ratio", "0.5"], "lag-partition method"),
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
