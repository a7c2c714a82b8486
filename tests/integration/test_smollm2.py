"""A few end-to-end checks on the real embedded SmolLM2-135M-Instruct (provisioned by `make test`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import kvtrim
from kvtrim.cli import app
from kvtrim.eval.metrics import METRICS
from kvtrim.eval.tasks import generate_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def passkeys(smollm2):
    _, tokenizer = smollm2
    return generate_task("passkey", tokenizer, 600, 3, seed=7)


def test_embedded_model_geometry(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        30,
        9,
        3,
    )


def test_passkey_answered_at_half_ratio_with_snapkv(smollm2, passkeys):
    model, tokenizer = smollm2
    for sample in passkeys:
        res = kvtrim.generate(
            model,
            tokenizer,
            sample.context,
            sample.question,
            method="snapkv",
            ratio=0.5,
            question_aware=True,
            answer_prefix=sample.answer_prefix,
            max_new_tokens=10,
        )
        assert METRICS["passkey_match"](res.answers[0], sample.answers) == 1.0, (res.answers, sample.answers)
        s = res.stats
        assert 550 <= s.context_tokens <= 640
        assert s.kv_entries_after == (s.context_tokens // 2) * 90  # int(T * (1 - 0.5)) per layer and KV head
        assert s.kv_bytes_after == s.kv_entries_after * 64 * 4 * 2


def test_full_cache_answers_passkey_context_only(smollm2, passkeys):
    model, tokenizer = smollm2
    session = kvtrim.Session(model, tokenizer, passkeys[0].context, answer_prefix=passkeys[0].answer_prefix)
    res = session.run("full", questions=passkeys[0].question, max_new_tokens=10)
    assert METRICS["passkey_match"](res.answers[0], passkeys[0].answers) == 1.0


def test_cli_generate_json_on_embedded_model(tmp_path, passkeys):
    f = tmp_path / "ctx.txt"
    f.write_text(passkeys[0].context)
    out = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            "smollm2-135m",
            "--method",
            "snapkv",
            "--ratio",
            "0.5",
            "--context-file",
            str(f),
            "--question",
            passkeys[0].question,
            "--answer-prefix",
            passkeys[0].answer_prefix,
            "--max-new-tokens",
            "8",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    for key in [
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
    ]:
        assert key in payload
    assert payload["method"] == "snapkv" and payload["ratio"] == 0.5
    assert payload["kv_bytes_after"] < payload["kv_bytes_before"]
