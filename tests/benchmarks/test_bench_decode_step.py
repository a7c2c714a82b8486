"""Smoke test of benchmarks/bench_decode_step.py on the CPU with the tiny random-weight shape."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_decode_step.py")


@pytest.mark.parametrize("extra", [[], ["--static-decode"]])
def test_tiny_run_measures_each_batch_at_its_size(bench, tmp_path, extra):
    result = bench.main(
        ["--shape", "tiny", "--batches", "1", "3", "--context", "96", "--rate", "4", "--min-cache-tokens", "16",
         "--protected-window", "8", "--steps", "3", "--warmup", "1", "--out-dir", str(tmp_path), *extra]
    )  # fmt: skip
    saved = json.loads((tmp_path / "decode_step.json").read_text())
    assert saved == json.loads(json.dumps(result))
    rows = saved["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["step_ms_median"] > 0 and 0 < r["decode_ms"] <= r["step_ms_mean"] * 1.5
        assert r["compress_ms"] > 0  # continual compression at rate 4 evicts during decoding
        assert r["entries_per_head"] < 96  # compressed below the prompt
        assert r["decode_kernel"] == "gather"
        assert r["static_decode_steps"] == (3 if extra else 0)
        assert r["ops_per_step"] > 50 and r["view_ops_per_step"] > 0
    # the model forward's ops do not grow with the batch (no loop over sequences); the rest of the step (compression)
    # depends on which sequences are due, not on how many
    assert rows[0]["forward_ops_per_step"] == rows[1]["forward_ops_per_step"] > 0
    assert all(r["forward_ops_per_step"] < r["ops_per_step"] for r in rows)
    md = (tmp_path / "decode_step.md").read_text()
    assert "| 3 |" in md and "static decode " + ("on" if extra else "off") in md


def test_prompts_shorter_than_a_chunk_decode_together_on_a_quantized_pool(bench, tmp_path):
    """Two prompts shorter than a prefill chunk, with a budget above their length (nothing to compress at first):
    admission counts the second for its projection plus its whole prompt uncompressed, and the pool leaves room
    for both, so the batch is 2 (a pool of one uncompressed copy each ran them one after the other). The packed
    pool's format is recorded."""
    result = bench.main(
        ["--shape", "tiny", "--batches", "2", "--context", "100", "--steps", "2", "--warmup", "1",
         "--kv-quant", "int8", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    (row,) = result["rows"]
    assert row["batch"] == 2 and row["step_ms_median"] > 0
    assert result["meta"]["kv_quant"] == "int8"
    assert "KV entries int8" in (tmp_path / "decode_step.md").read_text()


def test_cuda_graphs_on_a_cpu_is_refused(bench, tmp_path):
    from kvtrim.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="CUDA"):
        bench.main(["--shape", "tiny", "--batches", "1", "--context", "32", "--steps", "1", "--cuda-graphs",
                    "--out-dir", str(tmp_path)])  # fmt: skip
