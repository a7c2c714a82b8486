"""benchmarks/gpu_check.py on the CPU: the stage driver end to end at the tiny shape (methods, step), the kernels
stage's loud failure without its script, the target arithmetic, and the sync-debug scope of the tests stage."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(BENCH))
    return importlib.import_module("gpu_check")


def _load(out: pathlib.Path, stage: str) -> tuple[dict, str]:
    result = json.loads((out / f"gpu_check_{stage}.json").read_text())
    return result, (out / f"gpu_check_{stage}.md").read_text()


def test_methods_and_step_stages_run_on_cpu_and_report_targets(gc, tmp_path, capsys):
    rc = gc.main(
        ["methods", "step", "--device", "cpu", "--out-dir", str(tmp_path), "--methods", "hf,full,snapkv,adakv",
         "--contexts", "128", "--batches", "1,2", "--steps", "2", "--kernels", "gather"]
    )  # fmt: skip
    assert rc == 0
    methods, md = _load(tmp_path, "methods")
    assert methods["schema"] == gc.SCHEMA and methods["stage"] == "methods" and methods["status"] == "ok"
    assert methods["device"] == "cpu" and methods["torch"] == torch.__version__ and methods["triton"]
    assert set(methods["shapes"]) == {"tiny"} and methods["errors"] == []
    assert {(r["method"], r["batch"]) for r in methods["rows"]} == {
        (m, b) for m in ("hf", "full", "snapkv", "adakv") for b in (1, 2)
    }
    names = [t["name"] for t in methods["targets"]]
    for b in (1, 2):
        where = f"(ctx 128, batch {b})"
        assert f"kvtrim full / HF default decode {where}" in names
        assert f"ragged adakv / dense snapkv decode {where}" in names
        assert f"snapkv / kvtrim full decode {where}" in names and f"adakv / kvtrim full decode {where}" in names
    for t in methods["targets"]:
        assert set(t) == {"name", "value", "limit", "op", "met"} and t["value"] > 0
        assert t["met"] == (t["value"] <= t["limit"])
    assert "| kvtrim full / HF default decode (ctx 128, batch 1) |" in md
    assert "bench_gpu_tiny_cpu.json" in methods["files"] and (tmp_path / "bench_gpu_tiny_cpu.json").exists()

    step, md = _load(tmp_path, "step")
    assert step["status"] == "ok" and step["settings"]["modes"] == ["eager", "static"]
    assert [(r["mode"], r["batch"], r["status"]) for r in step["rows"]] == [
        ("eager", 1, "ok"), ("eager", 2, "ok"), ("static", 1, "ok"), ("static", 2, "ok")
    ]  # fmt: skip
    targets = {t["name"]: t for t in step["targets"]}
    assert targets["gather: static steps / timed steps (every batch)"]["met"] is True
    assert targets["gather eager: step at batch 2 / step at batch 1"]["value"] > 0
    assert "| gather: static steps / timed steps (every batch) | 1 | >= 1 | met |" in md
    shown = capsys.readouterr().out
    assert "== gpu_check methods: OK" in shown and "== gpu_check step: OK" in shown and "[         met]" in shown


def test_throughput_stage_adds_the_quantized_pool_at_cr_8_and_targets_the_unquantized_rows(gc, tmp_path):
    assert gc.main(["throughput", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    result, md = _load(tmp_path, "throughput")
    assert [(r["compression_rate"], r["kv_quant"]) for r in result["rows"]] == [
        (1.0, "none"), (4.0, "none"), (8.0, "none"), (8.0, "int8")
    ]  # fmt: skip
    assert result["files"][-2:] == ["serving_throughput.json", "serving_throughput_quant.json"]
    assert all((tmp_path / f).exists() for f in result["files"])
    (target,) = result["targets"]  # cr 8 / cr 1 of the unquantized pool only
    tput = {r["compression_rate"]: r["out_tok_per_s_wall"] for r in result["rows"] if r["kv_quant"] == "none"}
    assert target["value"] == pytest.approx(tput[8.0] / tput[1.0])
    assert "| 128 | 8 | int8 |" in md


def test_kernels_stage_fails_loudly_without_its_script(gc, tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "KERNELS_SCRIPT", tmp_path / "absent.py")
    assert gc.main(["kernels", "--device", "cpu", "--out-dir", str(tmp_path)]) == 1
    result, md = _load(tmp_path, "kernels")
    assert result["status"] == "failed" and "absent.py does not exist" in result["errors"][0]
    assert "Status **failed**" in md


def test_kernels_stage_runs_the_script_and_collects_its_rows_and_targets(gc, tmp_path, monkeypatch):
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import json, pathlib, sys\n"
        "a = sys.argv[1:]\n"
        "out = pathlib.Path(a[a.index('--out-dir') + 1])\n"
        "rows = [{'batch': 32, 'gbps': 1700.0, 'args': ' '.join(a)}]\n"
        "targets = [{'name': 'bandwidth batch 32 x 2k', 'value': 0.51, 'limit': 0.5}]\n"
        "(out / 'paged.json').write_text(json.dumps({'rows': rows, 'targets': targets}))\n"
        "(out / 'paged.md').write_text('# x')\n"
    )
    monkeypatch.setattr(gc, "KERNELS_SCRIPT", script)
    out = tmp_path / "out"
    assert gc.main(["kernels", "--device", "cpu", "--out-dir", str(out)]) == 0
    result, _ = _load(out, "kernels")
    assert result["rows"][0]["args"].startswith("--device cpu --dtype float32 --out-dir")
    assert result["targets"] == [gc.target("bandwidth batch 32 x 2k", 0.51, 0.5, ">=")]
    assert {"kernels/paged.json", "kernels/paged.md", "gpu_check_kernels.log"} <= set(result["files"])

    script.write_text(script.read_text().replace("'targets': targets", "'no_targets': targets"))
    assert gc.main(["kernels", "--device", "cpu", "--out-dir", str(tmp_path / "bare")]) == 1  # no targets: loud
    result, _ = _load(tmp_path / "bare", "kernels")
    assert result["status"] == "failed" and "no 'targets' list" in result["errors"][0]


def test_target_arithmetic(gc):
    rows = [
        {"method": "hf", "context": 4096, "batch": 1, "decode_ms": 40.0},
        {"method": "full", "context": 4096, "batch": 1, "decode_ms": 19.0},
        {"method": "snapkv", "context": 4096, "batch": 1, "decode_ms": 15.0},
        {"method": "adakv", "context": 4096, "batch": 1, "decode_ms": 18.0},
        {"method": "lagkv", "context": 4096, "batch": 1, "status": "OOM"},  # not measured: no value, met None
    ]
    t = {x["name"]: x for x in gc.method_targets(rows)}
    assert t["kvtrim full / HF default decode (ctx 4096, batch 1)"]["met"] is True  # 0.475 <= 0.5
    assert t["ragged adakv / dense snapkv decode (ctx 4096, batch 1)"]["value"] == pytest.approx(1.2)
    assert t["ragged adakv / dense snapkv decode (ctx 4096, batch 1)"]["met"] is False
    assert t["lagkv / kvtrim full decode (ctx 4096, batch 1)"] == gc.target(
        "lagkv / kvtrim full decode (ctx 4096, batch 1)", None, 1.1
    )
    assert t["lagkv / kvtrim full decode (ctx 4096, batch 1)"]["met"] is None
    tput = [{"input_len": 2048, "compression_rate": r, "out_tok_per_s_wall": v} for r, v in ((1, 100.0), (8, 310.0))]
    assert gc.throughput_targets(tput)[0]["met"] is True
    steps = [
        {"kernel": "triton", "mode": "graphs", "batch": 4, "status": "ok", "graph_replays": 20, "step_ms_median": 10.0},
        {"kernel": "triton", "mode": "graphs", "batch": 32, "status": "error"},
    ]
    (capture,) = [x for x in gc.step_targets(steps, 20, [4, 32]) if "graphs steps" in x["name"]]
    assert capture["value"] is None and capture["met"] is None  # one batch failed: capture not shown to work
    with pytest.raises(ValueError, match="op"):
        gc.target("x", 1.0, 1.0, "<")


def test_cuda_test_files_cover_the_required_and_every_file_that_checks_for_cuda(gc):
    files = gc.cuda_test_files()
    assert set(gc.REQUIRED_TESTS) <= set(files) and len(files) == len(set(files))
    assert "tests/serve/test_engine_cuda.py" in files and not any(f.endswith("conftest.py") for f in files)


def test_junit_rows(gc, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="t1" time="0.5"/>'
        '<testcase classname="tests.a" name="t2" time="1"><failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.b" name="t3" time="0"><skipped message="needs a CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = gc.parse_junit(xml)
    assert [(r["test"], r["outcome"], r["message"]) for r in rows] == [
        ("tests.a::t1", "passed", ""), ("tests.a::t2", "failed", "boom"),
        ("tests.b::t3", "skipped", "needs a CUDA device"),
    ]  # fmt: skip
    assert gc._junit_name("tests/a/test_b.py::test_c[x-y]") == "tests.a.test_b::test_c[x-y]"
    assert gc._junit_name("tests/a/test_b.py::TestD::test_e") == "tests.a.test_b.TestD::test_e"


def test_sync_debug_scope_holds_the_mode_over_decode_forwards_only():
    from conftest import tiny_model

    sys.path.insert(0, str(BENCH))
    from gpu_sync_debug import SyncDebugScope

    calls = []
    scope = SyncDebugScope("error", device_type="cpu", setter=calls.append, getter=lambda: 0)
    model = tiny_model()
    scope.install()
    try:
        with torch.no_grad():
            model(input_ids=torch.ones(2, 5, dtype=torch.long))  # prefill-shaped: untouched
            assert calls == [] and scope.decode_forwards == 0
            model(input_ids=torch.ones(2, 1, dtype=torch.long))  # decode-shaped: error mode, then restored
            model(torch.ones(3, 1, dtype=torch.long))  # positional input ids too
            assert calls == ["error", 0, "error", 0] and scope.decode_forwards == 2  # the inner model not again
            with pytest.raises(IndexError):  # a token id past the vocabulary
                model(input_ids=torch.full((2, 1), 10**6, dtype=torch.long))
            assert calls[-1] == 0  # restored after a failing forward
    finally:
        scope.uninstall()
    with torch.no_grad():
        model(input_ids=torch.ones(1, 1, dtype=torch.long))
    assert len(calls) == 6  # uninstalled: no more switching
    with pytest.raises(ValueError, match="KVTRIM_SYNC_DEBUG"):
        SyncDebugScope("loud")


def test_random_shapes_are_built_in_their_dtype_without_a_cast(gc, monkeypatch):
    """The step and throughput stages' model: built directly in bf16 (llama-8b in fp32 first would be 32 GB)."""
    import bench_serving_throughput as bench

    def no_cast(*args, **kwargs):
        raise AssertionError("the model was built in another dtype and cast")

    monkeypatch.setattr(torch.nn.Module, "to", no_cast)
    model, _ = bench.load("tiny", "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.q_proj.weight.float().std() > 0  # initialised, not left empty
