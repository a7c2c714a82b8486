"""Checks that the documentation tells the truth without running a model (used by ``tests/test_docs.py``).

Each check takes a page's text (and where needed its path and the repository root) and returns a list of problems,
one readable line each, so a test can run it on the real pages and on a planted bad page alike:

- :func:`command_problems`: every fenced ``kvtrim …`` command parses against the real CLI (subcommand, every flag,
  required options), through click's own parser, without invoking anything;
- :func:`python_problems`: every ``python`` block parses, its imports resolve and the ``kvtrim`` names it uses exist;
- :func:`link_problems`: every relative link lands on a file of the repository, and every ``#anchor`` on a heading;
- :func:`table_problems`: every table of numbers names, in its section, the command or results folder that made it,
  and every ``benchmarks/results/…`` path a page names exists;
- :func:`path_problems`: every repository file a page names exists;
- :func:`wording_problems` (pages) and :func:`code_wording_problems` (code): the text speaks of the project, not of
  how its work was organised.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import typer.main

try:  # the click that typer parses with (vendored by typer >= 0.24)
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")


@dataclass
class Block:
    """A fenced code block: its language tag (``""`` when none), its text and the page line it starts on."""

    lang: str
    code: str
    line: int


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start, body = m.group(2), m.group(3).lower(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(lang, "\n".join(body), start))
        i += 1
    return blocks


def prose(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced blocks, with inline code spans blanked."""
    out, in_fence, fence = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
            continue
        if not in_fence:
            out.append((n, re.sub(r"`[^`]*`", lambda s: " " * len(s.group(0)), line)))
    return out


# ------------------------------------------------------------------------------------------------ commands

SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
CONTROL = {"|", "||", "&&", ";", ">", ">>", "2>", "&", "<"}


def kvtrim_commands(code: str) -> list[tuple[int, list[str]]]:
    """The ``kvtrim …`` invocations of a shell block as ``(block line, argv after 'kvtrim')``.

    ``kvtrim``, ``.venv/bin/kvtrim`` and ``python -m kvtrim`` start one; ``\\`` continues a line, ``#`` starts a
    comment, and a pipe, ``&&``, ``;`` or a redirection ends the command."""
    joined, start, out = [], None, []
    for n, raw in enumerate([*code.splitlines(), ""], 1):
        line = raw.rstrip()
        if start is None:
            start = n
        joined.append(line[:-1] if line.endswith("\\") else line)
        if line.endswith("\\"):
            continue
        text, first = " ".join(joined).strip(), start
        joined, start = [], None
        text = re.sub(r"^\$\s+", "", text)
        try:
            words = shlex.split(text, comments=True)
        except ValueError:
            continue  # not shell (a JSON reply, a table)
        # a synopsis marks optional parts with brackets: `[--plot FILE]` is checked as `--plot FILE`
        words = [w[1:] if w.startswith("[") else w for w in words]
        words = [w[:-1] if w.endswith("]") and "[" not in w else w for w in words]
        while words:
            head = _command_start(words)
            if head is None:
                break
            rest = words[head:]
            end = next((k for k, w in enumerate(rest) if w in CONTROL), len(rest))
            out.append((first, rest[:end]))
            words = rest[end + 1 :]
    return out


def _command_start(words: list[str]) -> int | None:
    for k, w in enumerate(words):
        starts = k == 0 or words[k - 1] in CONTROL or "=" in words[k - 1] or words[k - 1] in {"time", "exec"}
        if (w == "kvtrim" or w.endswith("/bin/kvtrim")) and starts:
            return k + 1
        if w == "-m" and k + 1 < len(words) and words[k + 1] == "kvtrim" and k > 0 and "python" in words[k - 1]:
            return k + 2
    return None


def check_command(argv: list[str]) -> str | None:
    """None when ``kvtrim <argv>`` parses; otherwise click's message. Nothing is invoked."""
    from kvtrim.cli import app

    command = typer.main.get_command(app)
    parent: click.Context | None = None
    name, args = "kvtrim", list(argv)
    try:
        while True:
            if "--help" in args and not _is_group(command):
                return None
            if _is_group(command):
                if not args or args[0] == "--help":
                    return None
                sub = command.get_command(click.Context(command, info_name=name, parent=parent), args[0])
                if sub is None:
                    return f"no such command {args[0]!r} under {name!r}"
                parent = click.Context(command, info_name=name, parent=parent)
                name, command, args = args[0], sub, args[1:]
                continue
            command.make_context(name, args, parent=parent, resilient_parsing=False)
            return None
    except typer.Exit:  # --help
        return None
    except click.ClickException as exc:
        return exc.format_message()


def _is_group(command) -> bool:
    return hasattr(command, "commands")


def inline_commands(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of the inline code spans that are a whole ``kvtrim …`` command (a span may wrap a line).

    A span that only names a command or a flag (`kvtrim eval`, `kvtrim generate --json`) is not one: a span is read
    as a command when it gives at least two options and does not abbreviate itself with an ellipsis."""
    out, in_fence, fence, lines = [], False, "", text.splitlines()
    body = []
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
            body.append((n, ""))
            continue
        body.append((n, "" if in_fence else line))
    joined = "\n".join(line for _, line in body)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        code = " ".join(m.group(1).split())
        whole = code.count(" --") >= 2 and "..." not in code and "…" not in code
        if whole and code.startswith(("kvtrim ", ".venv/bin/kvtrim ", "python -m kvtrim ")):
            out.append((joined.count("\n", 0, m.start()) + 1, code))
    return out


def command_problems(text: str) -> list[str]:
    problems = []
    for n, code in inline_commands(text):
        for _, argv in kvtrim_commands(code):
            error = check_command(argv)
            if error:
                problems.append(f"line {n}: `kvtrim {' '.join(argv)}`: {error}")
    for block in fenced_blocks(text):
        if block.lang not in SHELL_LANGS:
            continue
        for n, argv in kvtrim_commands(block.code):
            error = check_command(argv)
            if error:
                problems.append(f"line {block.line + n}: `kvtrim {' '.join(argv)}`: {error}")
    return problems


# ------------------------------------------------------------------------------------------------ python

# Packages a page may import that the test environment need not have (extras of other venvs or of GPU machines).
OPTIONAL = {"vllm", "flash_attn", "triton", "kvpress", "openai", "matplotlib"}


def python_problems(text: str) -> list[str]:
    problems = []
    for block in fenced_blocks(text):
        if block.lang not in {"python", "py"}:
            continue
        code = textwrap.dedent(block.code)  # a block inside a list item is indented
        code = "\n".join(line for line in code.splitlines() if not line.startswith(("... ", ">>> ")))
        try:
            tree = ast.parse(code)
        except SyntaxError as exc:
            problems.append(f"line {block.line + (exc.lineno or 0)}: python block does not parse: {exc.msg}")
            continue
        problems += [f"line {block.line + n}: {p}" for n, p in _tree_problems(tree)]
    return problems


def _tree_problems(tree: ast.AST) -> list[tuple[int, str]]:
    problems, aliases = [], {}  # local name -> dotted kvtrim path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                error = _module_error(a.name)
                if error:
                    problems.append((node.lineno, error))
                elif a.name.split(".")[0] == "kvtrim":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "kvtrim"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            error = _module_error(node.module)
            if error:
                problems.append((node.lineno, error))
                continue
            if node.module.split(".")[0] != "kvtrim":
                continue
            for a in node.names:
                if a.name == "*":
                    continue
                if _resolve(f"{node.module}.{a.name}") is None:
                    problems.append((node.lineno, f"`from {node.module} import {a.name}`: no such name"))
                else:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain = _dotted(node)
            if chain and chain[0] in aliases and not isinstance(_parent_attr(tree, node), ast.Attribute):
                path = ".".join([aliases[chain[0]], *chain[1:]])
                if _resolve(path) is None:
                    problems.append((node.lineno, f"`{'.'.join(chain)}` ({path}) does not exist"))
    return problems


def _parent_attr(tree: ast.AST, child: ast.AST) -> ast.AST | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.value is child:
            return node
    return None


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _module_error(module: str) -> str | None:
    top = module.split(".")[0]
    if top in OPTIONAL or top in sys.stdlib_module_names:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found and top == "kvtrim":
        return f"`{module}` is not a kvtrim module"
    if not found and importlib.util.find_spec(top) is None:
        return f"`{module}` is not installed (and not a known optional package)"
    return None


def _resolve(path: str) -> object | None:
    """The object at a dotted ``kvtrim…`` path (modules imported as needed), or None."""
    parts = path.split(".")
    obj: object = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: k + 1]))
        except ModuleNotFoundError:
            return None
    return obj


# ------------------------------------------------------------------------------------------------ links

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_~]{1,3}(\S[^*_~]*?)[*_~]{1,3}", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page: its headings' slugs (GitHub numbers repeats ``-1``, ``-2``) and ``<a id=...>``."""
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for line in _heading_texts(text):
        m = HEADING.match(line)
        base = slug(m.group(2))
        k = seen.get(base, 0)
        out.add(base if k == 0 else f"{base}-{k}")
        seen[base] = k + 1
    return out


def _heading_texts(text: str) -> list[str]:
    # headings are read with their code spans (prose() blanks them)
    in_fence, fence, out = False, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
            continue
        if not in_fence and HEADING.match(line):
            out.append(line)
    return out


def link_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    problems = []
    own = anchors(text)
    for n, line in prose(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            if not path:
                if anchor not in own:
                    problems.append(f"line {n}: anchor #{anchor} is not a heading of this page")
                continue
            dest = (page.parent / path).resolve()
            try:
                dest.relative_to(root.resolve())
            except ValueError:
                problems.append(f"line {n}: {target} leaves the repository")
                continue
            if not dest.exists():
                problems.append(f"line {n}: {target}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"line {n}: {target}: no heading #{anchor} in {path}")
    return problems


# ------------------------------------------------------------------------------------------------ number tables

NUMBER_CELL = re.compile(
    r"^[*_~<>≤≥≈~+−-]*\s*[-+−]?\d[\d,.]*\s*(%|×|x|ms|s|µs|us|MiB|GiB|KiB|MB|GB|tok/s|ms/token|B|k)?[*_]*$"
)
RESULTS_PATH = re.compile(r"(?<![\w/.])(?:benchmarks/)?results/[^\s`'\")\]|]*")
WILDCARD = re.compile(r"[*…{]")
SOURCE = re.compile(
    r"benchmarks/results/|`(?:\.venv/bin/)?kvtrim [a-z]|`(?:\.venv/bin/)?python[^`]* (?:benchmarks|tools)/|"
    r"`make [a-z]|`bash benchmarks/|tests/\S+\.py"
)


def _sections(text: str) -> list[tuple[int, list[str]]]:
    """The page cut at its headings: ``(first line number, lines)``; fenced blocks stay whole."""
    sections, current, start, in_fence, fence = [], [], 1, False, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
        if not in_fence and HEADING.match(line) and current:
            sections.append((start, current))
            current, start = [], n
        current.append(line)
    sections.append((start, current))
    return sections


def _tables(lines: list[str]) -> list[tuple[int, list[list[str]]]]:
    """Markdown tables in ``lines``: ``(index of the header line, body rows as cells)``. A table whose header has
    a ``default`` column lists settings, not measurements, and is left out."""
    tables, k = [], 0
    while k + 1 < len(lines):
        if lines[k].lstrip().startswith("|") and re.match(r"^\s*\|?\s*:?-{3,}", lines[k + 1]):
            body, j = [], k + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                body.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
                j += 1
            if "default" not in lines[k].lower():
                tables.append((k, body))
            k = j
        else:
            k += 1
    return tables


def table_problems(text: str, root: Path = ROOT) -> list[str]:
    problems = []
    for start, lines in _sections(text):
        section = "\n".join(lines)
        for k, body in _tables(lines):
            numbers = sum(bool(NUMBER_CELL.match(c.replace("**", ""))) for row in body for c in row)
            if numbers >= 2 and not SOURCE.search(section):
                problems.append(
                    f"line {start + k}: a table of numbers whose section names no command or results folder"
                )
    for n, line in enumerate(text.splitlines(), 1):
        for path in RESULTS_PATH.findall(line):
            path = path.rstrip(".,;:")
            path = path if path.startswith("benchmarks/") else "benchmarks/" + path  # `results/x` on a page
            if "<" in path:  # a template (`…/bench_gpu_<shape>_<device>.json`): where a run writes, not a citation
                continue
            if WILDCARD.search(path):  # `…/kvpress_methods_*`, `x.{json,md}`
                prefix = WILDCARD.split(path)[0]
                hits = list(root.glob(prefix.rstrip("/") + "*")) if prefix.strip("/") else [root]
                if not hits:
                    problems.append(f"line {n}: nothing matches {path}")
            elif not (root / path).exists():
                problems.append(f"line {n}: {path} does not exist")
    return problems


# ------------------------------------------------------------------------------------------------ file paths

REPO_PATH = re.compile(r"(?<![\w/.~-])((?:src|tests|benchmarks|tools|docs|\.ci)/[\w./-]*\.(?:py|md|sh|json|toml))\b")


def path_problems(text: str, root: Path = ROOT) -> list[str]:
    """Every repository file a page names (``src/kvtrim/x.py``, ``tests/…/test_y.py``, ``docs/z.md``) exists."""
    return [
        f"line {n}: {path} does not exist"
        for n, line in enumerate(text.splitlines(), 1)
        for path in REPO_PATH.findall(line)
        if not (root / path).exists()
    ]


# ------------------------------------------------------------------------------------------------ wording

ORGANISATION = re.compile(
    r"\bsessions?\s?\d|\bissues?\s?#?\d+|\bhelpers?\b(?! (?:function|module|class|method)s?\b)|\bthe lead\b|"
    r"\bworktree|\bdevice tool\b|\bdevice call\b|\bwas filed\b|\bwere lent\b|\bwas lent\b",
    re.IGNORECASE,
)


# In code, "helper" is a word of the trade (a helper function); the rest of the list applies.
CODE_ORGANISATION = re.compile(
    r"\bsessions?\s?\d|\bissues?\s?#?\d+|\bthe lead\b|\bworktree|\bdevice tool\b|\bdevice call\b|\bwas filed\b",
    re.IGNORECASE,
)


def code_files(root: Path = ROOT) -> list[Path]:
    """Python and shell sources of the package, the tests, the benchmarks and the tools (not this checker)."""
    here = {Path(__file__).resolve(), (Path(__file__).parent / "test_docs.py").resolve()}
    dirs = [root / d for d in ("src", "tests", "benchmarks", "tools")]
    files = [p for d in dirs for ext in ("py", "sh") for p in d.rglob(f"*.{ext}")]
    return sorted(p for p in files if p.resolve() not in here)


def _matches(pattern: re.Pattern, text: str) -> list[str]:
    """One problem per match, found in the whole text (a phrase may wrap a line), named by its first line."""
    return [
        f"line {text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group(0).split())!r} speaks of how the work was "
        "organised"
        for m in pattern.finditer(text)
    ]


def code_wording_problems(text: str) -> list[str]:
    return _matches(CODE_ORGANISATION, text)


def wording_problems(text: str) -> list[str]:
    return _matches(ORGANISATION, text)
