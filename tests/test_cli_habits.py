"""Command-line start-up, `kvtrim methods --list`, and the --device/--dtype/--prompt-format/sampling options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.cli import app
from kvtrim.methods import method_names

runner = CliRunner()
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout


def test_help_does_not_import_torch_or_transformers():
    out = _python(
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvtrim.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


def test_import_kvtrim_is_lazy_but_complete():
    out = _python("import sys, kvtrim\nprint('torch' in sys.modules)\nprint(kvtrim.generate.__module__)\n"
                  "import kvtrim.methods\nprint(callable(kvtrim.methods))")  # fmt: skip
    assert out.split() == ["False", "kvtrim.api", "True"]  # the submodule does not hide kvtrim.methods()


def test_python_dash_m_kvtrim_works():
    env = {**os.environ, "PYTHONPATH": SRC}
    result = subprocess.run([sys.executable, "-m", "kvtrim", "methods", "--list"], capture_output=True, text=True,
                            env=env, check=True)  # fmt: skip
    assert len(result.stdout.strip().splitlines()) == len(method_names())


def test_methods_list_is_one_line_per_method():
    result = runner.invoke(app, ["methods", "--list"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert [line.split()[0] for line in lines] == method_names()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def context_file(tmp_path):
    f = tmp_path / "ctx.txt"
    f.write_text(random_text(100, seed=4))
    return f


def _generate(saved_model, context_file, *extra):
    args = ["generate", "--model", str(saved_model), "--context-file", str(context_file), "--question", "q?",
            "--ratio", "0.5", "--max-new-tokens", "6", "--json", *extra]  # fmt: skip
    return runner.invoke(app, args)


def test_generate_sampling_and_layout_options(saved_model, context_file):
    a = _generate(saved_model, context_file, "--do-sample", "--seed", "5", "--top-k", "20", "--prompt-format",
                  "kvpress", "--device", "cpu", "--dtype", "float32")  # fmt: skip
    b = _generate(saved_model, context_file, "--do-sample", "--seed", "5", "--top-k", "20", "--prompt-format",
                  "kvpress")  # fmt: skip
    assert a.exit_code == 0, a.output
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (a, b))
    assert first["answer"] == second["answer"]
    assert first["prompt_format"] == "kvpress"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "bfloat8"], "dtype must be one of"),
        (["--prompt-format", "vllm"], "prompt_format must be one of"),
        (["--temperature", "0"], "temperature must be a number"),
    ],
)
def test_generate_option_errors(saved_model, context_file, extra, message):
    result = _generate(saved_model, context_file, *extra)
    assert result.exit_code == 2
    assert message in result.output
