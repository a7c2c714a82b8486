"""README.md and docs/*.md tell the truth: every check of ``docs_check`` passes on every page and fails on a page
planted with the defect it looks for. No model runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from docs_check import (
    ROOT,
    check_command,
    code_files,
    code_wording_problems,
    command_problems,
    doc_pages,
    link_problems,
    path_problems,
    python_problems,
    slug,
    table_problems,
    wording_problems,
)

PAGES = doc_pages()
IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def test_pages_found():
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 15


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_commands_parse(page):
    assert command_problems(read(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_blocks_resolve(page):
    assert python_problems(read(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_links_resolve(page):
    assert link_problems(page, read(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_number_tables_name_their_source(page):
    assert table_problems(read(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_files_exist(page):
    assert path_problems(read(page)) == []


WORDED = [
    *PAGES,
    ROOT / "benchmarks" / "README.md",
    ROOT / "benchmarks" / "results" / "INDEX.md",
    *sorted((ROOT / "benchmarks" / "results").rglob("NOTES.md")),
    ROOT / "Makefile",
]


@pytest.mark.parametrize("page", WORDED, ids=[str(p.relative_to(ROOT)) for p in WORDED])
def test_pages_speak_of_the_project(page):
    assert wording_problems(read(page)) == []


def test_code_speaks_of_the_project():
    problems = [f"{p.relative_to(ROOT)} {x}" for p in code_files() for x in code_wording_problems(read(p))]
    assert problems == []


# ------------------------------------------------------------------ each check fails on a planted defect


def plant(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    page = tmp_path / "docs" / name
    page.write_text(text, encoding="utf-8")
    return page


def test_real_commands_parse():
    assert check_command(["eval", "--tasks", "passkey", "--out", "runs/a"]) is None
    assert check_command(["calibrate", "--help"]) is None
    assert check_command(["models", "fetch"]) is None


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("kvtrim eval --methods snapkv --out runs/a", "Missing option '--tasks'"),
        ("kvtrim generate --no-such-flag 1", "No such option"),
        ("kvtrim evaluate --tasks passkey", "no such command"),
        (".venv/bin/kvtrim calibrate nothing --model x", "no such command"),
        ("python -m kvtrim serve --model m \\\n    --kv-memroy 1GiB   # a typo", "No such option"),
        ("export X=1 && kvtrim demo --sample 3", "No such option"),
    ],
)
def test_command_check_fails_on_planted_command(block, expected):
    problems = command_problems(f"text\n\n```bash\n{block}\n```\n")
    assert len(problems) == 1 and expected in problems[0], problems


def test_command_check_reads_only_shell_blocks():
    assert command_problems("```python\nkvtrim = 1\n```\n`kvtrim nothing` in prose\n") == []


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import kvtrim.integration.pipeline", "not a kvtrim module"),
        ("from kvtrim import no_such_function", "no such name"),
        ("import kvtrim\nkvtrim.no_such_function()", "does not exist"),
        ("import kvtrim as kt\nkt.Session.no_such_method", "does not exist"),
        ("import not_a_package_anyone_has", "not installed"),
        ("x = (", "does not parse"),
    ],
)
def test_python_check_fails_on_planted_block(code, expected):
    problems = python_problems(f"```python\n{code}\n```\n")
    assert len(problems) == 1 and expected in problems[0], problems


def test_python_check_passes_real_names():
    code = "import kvtrim\nfrom kvtrim.eval.tasks import generate_task\nkvtrim.Session\nkvtrim.load_model('m')\n"
    assert python_problems(f"```python\n{code}```\n") == []


def test_slug_is_github_style():
    assert slug("Models, devices and dtypes") == "models-devices-and-dtypes"
    assert slug("`kvtrim serve` flags (GPU)") == "kvtrim-serve-flags-gpu"
    assert slug("2.67× on a CPU") == "267-on-a-cpu"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see [x](missing.md)", "does not exist"),
        ("see [x](other.md#no-such-heading)", "no heading #no-such-heading"),
        ("# Top\n\nsee [x](#nowhere)", "not a heading of this page"),
        ("see [x](../../outside.md)", "leaves the repository"),
    ],
)
def test_link_check_fails_on_planted_link(tmp_path, text, expected):
    plant(tmp_path, "# Other\n\n## Real heading\n", "other.md")
    problems = link_problems(plant(tmp_path, text), text, root=tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems


def test_link_check_passes_real_link(tmp_path):
    plant(tmp_path, "# Other\n\n## Real heading\n\n## Real heading\n", "other.md")
    text = "# Top\n\n[a](other.md#real-heading) [b](other.md#real-heading-1) [c](#top) `[d](nowhere.md)`\n"
    assert link_problems(plant(tmp_path, text), text, root=tmp_path) == []


TABLE = "| method | score |\n|---|---:|\n| a | 12.5 |\n| b | 40 % |\n"


def test_table_check_fails_on_unsourced_numbers(tmp_path):
    problems = table_problems(f"## Results\n\nSome numbers.\n\n{TABLE}\n## Next\n\n`kvtrim eval` elsewhere\n", tmp_path)
    assert len(problems) == 1 and "names no command" in problems[0], problems


def test_table_check_fails_on_missing_results_folder(tmp_path):
    text = f"## Results\n\nMade by `kvtrim eval` into `benchmarks/results/gone/`.\n\n{TABLE}"
    problems = table_problems(text, tmp_path)
    assert len(problems) == 1 and "benchmarks/results/gone/ does not exist" in problems[0], problems
    (tmp_path / "benchmarks" / "results" / "gone").mkdir(parents=True)
    assert table_problems(text, tmp_path) == []


def test_table_check_ignores_tables_without_numbers(tmp_path):
    assert table_problems("| flag | meaning |\n|---|---|\n| `--x` | one |\n", tmp_path) == []


@pytest.mark.parametrize(
    "line",
    ["as measured in issue 14", "the run of session 6", "six other helpers shared it", "Issue #19's sweep", "issue\n1"],
)
def test_wording_check_fails_on_organisational_words(line):
    assert len(wording_problems(f"# Page\n\n{line}.\n")) == 1


def test_wording_check_allows_the_api():
    assert wording_problems("`kvtrim.Session` keeps helper functions private; see docs/decisions.md entry 12.") == []


def test_table_check_ignores_settings_tables(tmp_path):
    assert table_problems("| option | default |\n|---|---|\n| `--a` | 16 |\n| `--b` | 4096 |\n", tmp_path) == []


def test_path_check_fails_on_a_missing_file(tmp_path):
    (tmp_path / "src" / "kvtrim").mkdir(parents=True)
    (tmp_path / "src" / "kvtrim" / "methods.py").write_text("")
    text = "See `src/kvtrim/methods.py` and `tests/cache/test_kvcache.py`."
    assert path_problems(text, tmp_path) == ["line 1: tests/cache/test_kvcache.py does not exist"]


def test_code_wording_check():
    assert len(code_wording_problems("# measured on an H100 (issue 13)\n")) == 1
    assert code_wording_problems("# ---------- helpers\n") == []
