"""The list of vLLM definitions kvtrim relies on, and the comparison that decides whether a release is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrim.vllm.patch_surface import PATCH_SURFACE, compare_definition
from script_loader import load_script

OLD = '''
class Runner:
    def step(self, x):
        """Run one step."""
        return x + 1  # one more


def helper():
    return 0
'''


def _tool():
    return load_script("tools/vllm_patch_surface.py")


def test_comments_formatting_and_docstrings_do_not_count_but_code_does():
    reformatted = OLD.replace('"""Run one step."""', '"""Run a step (reworded)."""').replace(
        "x + 1  # one more", "(x\n + 1)"
    )
    assert compare_definition(OLD, reformatted, "Runner.step") == "same"
    assert compare_definition(OLD, OLD.replace("x + 1", "x + 2"), "Runner.step") == "changed"
    assert compare_definition(OLD, OLD.replace("x + 1", "x + 2"), "helper") == "same"
    assert compare_definition(OLD, OLD.replace("def step(self, x)", "def step(self, x, y=0)"), "Runner") == "changed"
    assert compare_definition(OLD, OLD.replace("def helper", "def helper2"), "helper") == "missing"
    assert compare_definition(OLD, None, "helper") == "missing"


def _tree(root: Path, body: str) -> Path:
    """A fake vLLM holding every listed definition, each returning ``body``."""
    files: dict[str, dict[str, list[str]]] = {}
    for entry in PATCH_SURFACE:
        *outer, name = entry.qualname.split(".")
        files.setdefault(entry.path, {}).setdefault(outer[0] if outer else "", []).append(name)
    for path, owners in files.items():
        lines = []
        for owner, names in owners.items():
            indent = "    " if owner else ""
            if owner:
                lines.append(f"class {owner}:")
            for name in names:
                lines += [f"{indent}def {name}():", f"{indent}    return {body}"]
        file = root / "vllm" / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("\n".join(lines) + "\n")
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_text("__version__ = version = '9.9.0'\n")
    return root


def test_tool_reports_each_definition_and_fails_on_a_change(tmp_path, capsys):
    tool = _tool()
    old = _tree(tmp_path / "old", "1")
    assert tool.main([str(old), str(old)]) == 0
    assert f"{len(PATCH_SURFACE)} of {len(PATCH_SURFACE)} definitions unchanged" in capsys.readouterr().out
    new = _tree(tmp_path / "new", "1")
    first = new / "vllm" / PATCH_SURFACE[0].path
    first.write_text(first.read_text().replace("return 1", "return 2", 1))
    assert tool.main([str(old), str(new / "vllm"), "--diff"]) == 1
    out = capsys.readouterr().out
    assert f"CHANGED  {PATCH_SURFACE[0].path}:{PATCH_SURFACE[0].qualname}" in out
    assert "-        return 1" in out and "+        return 2" in out  # Scheduler.__init__, a method
    assert "vllm 9.9.0" in out


def test_every_wrapped_definition_is_listed_and_found_in_the_installed_vllm():
    pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that
    import vllm
    from kvtrim.vllm.worker_patch import PATCHED_RUNNER_METHODS

    listed = {(e.path, e.qualname) for e in PATCH_SURFACE}
    wrapped = {("v1/worker/gpu_model_runner.py", f"GPUModelRunner.{m}") for m in PATCHED_RUNNER_METHODS}
    wrapped |= {("config/vllm.py", "VllmConfig.use_v2_model_runner")}
    wrapped |= {("v1/worker/worker_base.py", "WorkerWrapperBase.init_device")}
    assert wrapped <= listed
    root = Path(vllm.__file__).parent
    absent = [e for e in PATCH_SURFACE if compare_definition(*[(root / e.path).read_text()] * 2, e.qualname) != "same"]
    assert absent == []


def test_every_override_trusted_to_call_a_wrapper_is_compared_between_releases():
    from kvtrim.vllm.wrappers import SUPER_CALLING_OVERRIDES

    listed = {"vllm." + e.path.removesuffix(".py").replace("/", ".") + "." + e.qualname for e in PATCH_SURFACE}
    assert listed >= SUPER_CALLING_OVERRIDES


def test_the_compared_release_is_accepted_and_the_next_is_refused():
    from kvtrim.vllm.plugin import UnsupportedVLLMVersionError, check_version

    for version in ("0.32.0", "0.32.1", "0.33.0"):
        check_version(version)
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMVersionError, match=r"0\.32\.x, 0\.33\.x, found"):
            check_version(version)
