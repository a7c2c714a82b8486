"""The README's method table, generated from the registry (``kvtrim methods --markdown``).

One row per method, grouped by family in the order of :data:`kvtrim.methods.FAMILIES`: name, family, paper
(first author and arXiv link), and the capabilities its parts declare. ``kvtrim methods --markdown --write
README.md`` replaces the text between :data:`START` and :data:`END`, so the README cannot drift from the
registry (a test compares them).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InvalidParameterError
from .registry import MethodInfo, registered

START = "<!-- methods-table:start -->"
END = "<!-- methods-table:end -->"

_ARXIV = re.compile(r"arXiv (\d{4}\.\d{4,5})")
_AUTHORS = re.compile(r"[A-Z][\w-]* et al\.")


def cite(paper: str) -> str:
    """``"Li et al., SnapKV: … (arXiv 2404.14469)"`` → ``"Li et al. [2404.14469](https://arxiv.org/abs/2404.14469)"``.

    Each ``;``-separated citation with an arXiv id gives its author (or its title when it names none) and a link;
    a citation without an id is left out; none at all gives ``—``.
    """
    out, seen = [], set()
    for part in paper.split(";"):
        ids = [i for i in _ARXIV.findall(part) if i not in seen]
        if not ids:
            continue
        seen.update(ids)
        head = part.strip().split(",")[0]
        authors = _AUTHORS.search(part)
        who = authors.group(0) if authors else head if " " not in head else head.split(":")[0]
        links = ", ".join(f"[{i}](https://arxiv.org/abs/{i})" for i in ids)
        out.append(f"{who} {links}".strip())
    return "; ".join(out) or "—"


def _family_order() -> dict[str, int]:
    from . import FAMILIES  # the package imports this module's siblings first

    return {module.FAMILY: i for i, module in enumerate(FAMILIES)}


def _row(info: MethodInfo) -> str:
    return f"| `{info.name}` | {info.family} | {cite(info.paper)} | {', '.join(info.capabilities.labels())} |"


def markdown_table() -> str:
    """The method table in Markdown (ends with a newline)."""
    lines = ["| method | family | paper | capabilities |", "|---|---|---|---|"]
    order = _family_order()
    lines += [_row(info) for info in sorted(registered(), key=lambda info: order[info.family])]  # stable sort
    return "\n".join(lines) + "\n"


def replace_block(text: str, table: str, start: str = START, end: str = END) -> str:
    """``text`` with everything between the markers ``start`` and ``end`` replaced by ``table``.

    Raises:
        InvalidParameterError: the markers are missing, repeated or out of order
    """
    starts, ends = text.count(start), text.count(end)
    if starts != 1 or ends != 1 or text.index(start) > text.index(end):
        raise InvalidParameterError(
            f"the file must hold {start!r} then {end!r}, once each (found {starts} and {ends}); add them around the "
            "generated table"
        )
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{table}{end}{tail}"


def read_block(text: str, start: str = START, end: str = END) -> str:
    """The text between the markers (what :func:`replace_block` put there)."""
    replace_block(text, "", start, end)  # validates the markers
    return text.split(start)[1].split(end)[0].removeprefix("\n")


def write_block(path: str | Path, table: str, start: str = START, end: str = END) -> bool:
    """Replace the block between the markers in the file at ``path`` by ``table``; returns whether it changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    new = replace_block(text, table, start, end)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def write_table(path: str | Path) -> bool:
    """Replace the method table block in the file at ``path``; returns whether the file changed."""
    return write_block(path, markdown_table())
