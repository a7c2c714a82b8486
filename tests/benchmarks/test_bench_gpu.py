"""Smoke test of benchmarks/bench_gpu.py on the CPU with the tiny shape and a reduced method list."""

from __future__ import annotations

import json

import pytest
import torch

from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_gpu.py")


def test_tiny_cpu_run_writes_json_and_markdown_and_records_failures(bench, tmp_path):
    methods = "hf,full,snapkv,lagkv,adakv,headkv"  # headkv needs an artifact the random model lacks: an error row
    result = bench.main(
        ["--device", "cpu", "--shape", "tiny", "--methods", methods, "--contexts", "256", "--batches", "1",
         "--steps", "2", "--decode-warmup", "1", "--generate", "--out", str(tmp_path)]
    )  # fmt: skip
    saved = json.loads((tmp_path / "bench_gpu_tiny_cpu.json").read_text())
    assert saved == json.loads(json.dumps(result))
    rows = {r["method"]: r for r in saved["rows"]}
    assert set(rows) == set(methods.split(","))
    assert rows["headkv"]["status"] == "error" and "MissingArtifactError" in rows["headkv"]["error"]
    for name in ("hf", "full", "snapkv", "lagkv", "adakv"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["prefill_s"] > 0 and r["decode_ms"] > 0 and r["generate_decode_ms"] >= 0
        # tiny: 4 layers x 2 KV heads x head_dim 32, K and V, fp32, 256 tokens
        assert r["kv_bytes_prefill"] == 4 * 2 * 32 * 2 * 4 * 256
    for name in ("snapkv", "adakv"):  # 8x compression: 1/8 of the entries kept
        r = rows[name]
        assert r["compress_s"] > 0 and r["entries_after"] == r["entries_before"] // 8
        assert r["kv_bytes_compressed"] < r["kv_bytes_prefill"] / 4
    assert rows["full"]["kv_bytes_compressed"] == rows["full"]["kv_bytes_prefill"]
    assert saved["meta"]["shape"] == "tiny" and saved["meta"]["hf_attention"] == "sdpa"
    md = (tmp_path / "bench_gpu_tiny_cpu.md").read_text()
    assert "| snapkv | 256 | 1 |" in md and "error: MissingArtifactError" in md


def test_out_of_memory_is_recorded_not_raised(bench, monkeypatch):
    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(bench, "run_config", boom)
    row = bench.guarded(None, "snapkv", 32768, 8, None, torch.device("cpu"))
    assert row["status"] == "OOM" and "20.00 GiB" in row["error"] and row["context"] == 32768


def test_shapes_match_the_named_models(bench):
    cfg = bench.SHAPES["llama-8b"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (32, 4096, 32)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]) == (8, 14336, 128256)
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", "snapkv,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--ratio", "1.5"])


def test_defaults_bound_the_run(bench):
    """The default run fits one stage of benchmarks/gpu_check.sh: a bounded method set, one prefill per
    configuration."""
    args = bench.parse_args([])
    assert args.methods == list(bench.DEFAULT_METHODS) and len(args.methods) <= 8
    assert (args.contexts, args.batches, args.generate, args.prefill_chunk) == ([4096, 32768], [1, 8], False, 4096)
    assert set(bench.parse_args(["--methods", "all"]).methods) > set(args.methods)


def test_chunked_prefill_holds_the_whole_prompt_then_compresses(bench, tmp_path):
    result = bench.main(
        ["--device", "cpu", "--shape", "tiny", "--methods", "hf,full,h2o", "--contexts", "200", "--batches", "1",
         "--steps", "1", "--decode-warmup", "0", "--prefill-chunk", "64", "--out", str(tmp_path)]
    )  # fmt: skip
    rows = {r["method"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    exact = 4 * 2 * 32 * 2 * 4 * 200  # every token of the 4 chunks stored
    assert rows["hf"]["kv_bytes_prefill"] == exact
    assert rows["full"]["kv_bytes_prefill"] >= exact  # kvtrim's dense store keeps append slack after chunk appends
    assert rows["h2o"]["entries_before"] == 200 * 4 * 2  # tokens x layers x KV heads
    assert rows["h2o"]["entries_after"] == rows["h2o"]["entries_before"] // 8
    assert result["meta"]["prefill_chunk"] == 64
