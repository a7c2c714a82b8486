"""Smoke test of benchmarks/bench_paged_kernels.py on the CPU (Triton under its interpreter, tiny shapes)."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script

pytest.importorskip("triton")



@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_paged_kernels.py")


def test_tiny_cpu_run_writes_every_kernel_row(bench, tmp_path):
    result = bench.main(
        ["--device", "cpu", "--shapes", "2x40", "1x300", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32",
         "--dtype", "float32", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path),
         "--quant-formats", "int4", "int4:rotate=0"]
    )  # fmt: skip
    saved = json.loads((tmp_path / "bench_paged_kernels_cpu.json").read_text())
    assert saved == json.loads(json.dumps(result))
    rows = saved["rows"]
    kernels = ["triton", "triton+metric", "vllm_flash_attn", "flash_attn", "gather", "triton_quant_int4",
               "triton_quant_int4:rotate=0"]  # fmt: skip
    assert [(r["batch"], r["context"], r["kernel"]) for r in rows] == [
        (b, c, k) for b, c in ((2, 40), (1, 300)) for k in kernels
    ]
    for r in rows:
        if r["kernel"] in ("vllm_flash_attn", "flash_attn"):  # never on a CPU: skipped with the reason
            assert r["status"] == "skipped" and r["reason"]
            continue
        assert r["status"] == "ok" and r["ms_median"] > 0 and r["gbps"] > 0 and r["pct_peak"] is None
        assert r["timed"] == "eager" and r["graph_ms_median"] is None  # graphs are CUDA only
        assert r["max_abs_diff_vs_gather"] < 1e-5  # every kernel computes the same attention (quant: dequantized)
        # K and V of rows * context entries (head_dim 32, fp32; int4: 16 code bytes + float16 scale and zero)
        # plus the block tables
        width = -(-r["context"] // 16)
        entry = 2 * (16 + 2 + 2) if r["kernel"].startswith("triton_quant_int4") else 2 * 32 * 4
        assert r["bytes_read"] == r["rows"] * r["context"] * entry + r["rows"] * width * 4
    triton_long = next(r for r in rows if r["kernel"] == "triton" and r["context"] == 300)
    assert triton_long["splits"] == 2 and triton_long["config"]["BLOCK_N"] > 0  # a long row is split
    # no target shape was run and a CPU has no peak: both bandwidth targets are present, unmeasured
    assert [(t["limit"], t["op"], t["value"]) for t in saved["targets"]] == [(50.0, ">=", None), (30.0, ">=", None)]
    md = (tmp_path / "bench_paged_kernels_cpu.md").read_text()
    assert "| 1 × 300 | triton |" in md and "| skipped: " in md


def test_a_quant_format_a_pool_refuses_is_an_argument_error(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quant-formats", "int4:sink=1"])
    assert "sink must be 0" in capsys.readouterr().err


def test_bandwidth_targets_read_the_triton_row_of_each_target_shape(bench):
    def row(kernel, batch, context, pct, status="ok"):
        return {"kernel": kernel, "batch": batch, "context": context, "pct_peak": pct, "status": status}

    rows = [row("gather", 32, 2048, 90.0), row("triton+metric", 32, 2048, 70.0), row("triton", 32, 2048, 55.0),
            row("triton", 1, 32768, 12.0, status="error"), row("triton", 4, 8192, 40.0)]  # fmt: skip
    got = {t["name"]: (t["value"], t["limit"]) for t in bench.bandwidth_targets(rows)}
    assert got == {"triton % of peak bandwidth, batch 32 x 2048": (55.0, 50.0),
                   "triton % of peak bandwidth, batch 1 x 32768": (None, 30.0)}  # fmt: skip


def test_peak_bandwidth_by_device_name(bench):
    assert bench.peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert bench.peak_gbps("NVIDIA H200") == 4800.0
    assert bench.peak_gbps("some CPU") is None


def test_bad_shape_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--shapes", "32by2048", "--out-dir", str(tmp_path)])
