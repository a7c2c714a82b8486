"""Smoke test of benchmarks/bench_kvquant_bytes.py at a tiny shape: its rows are the stores' bytes formula."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_kvquant_bytes.py")


def test_tiny_run_writes_the_formula_for_every_spec(bench, tmp_path):
    out = tmp_path / "bytes.json"
    result = bench.main(["--contexts", "1024", "--head-dim", "16", "--layers", "2", "--kv-heads", "3",
                         "--out", str(out), "--kv-quant", "int4", "int4:group_size=64,residual=0,sink=0"])  # fmt: skip
    assert json.loads(out.read_text()) == result and out.with_suffix(".md").exists()
    rows = {r["kv_quant"]: r for r in result["rows"]}
    assert set(rows) == {"none", "int4", "int4:group_size=64,residual=0,sink=0"}
    # 128 kept of 1,024 per head; int4's default: a one-entry float16 sink, 95 quantized (codes 16 B, value scales
    # 4 B; key scales 64 B per group: one whole group of 64 and a partial one of 31) and a 32-entry float16 window
    default = rows["int4"]
    assert (default["resolved"], default["quantized_entries"], default["window_entries"], default["sink_entries"]) == (
        "int4:group_size=64,residual=32,sink=1,rotate=1", 95, 32, 1
    )
    assert default["head_bytes"] == 95 * (16 + 4) + 2 * 64 + 33 * 2 * 16 * 2
    assert rows["int4:group_size=64,residual=0,sink=0"]["head_bytes"] == 128 * (16 + 1 + 4)
    assert rows["none"]["head_bytes"] == 128 * 2 * 16 * 2
    for r in result["rows"]:
        assert r["model_bytes"] == 6 * r["head_bytes"]
        assert r["full_cache_over_held"] == pytest.approx(1024 * 2 * 16 * 2 / r["head_bytes"])
