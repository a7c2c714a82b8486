"""Haystack texts for the synthetic long-context tasks.

Three kinds of haystack are available:

* ``"noise"``: RULER's repeated block "The grass is green. The sky is blue. The sun is yellow. Here we go.
  There and back again." (one block per line).
* ``"jargon"``: natural English prose from the Jargon File 4.4.7 (public domain), as packaged by Debian in
  ``dict-jargon``. It stands in for the Paul Graham essays that RULER and Kamradt's needle test use, which
  are not openly licensed. :func:`fetch_haystack` provisions it without root (``apt-get download`` +
  ``dpkg-deb -x``), strips the dictd formatting into prose paragraphs and caches the result under
  ``$KVTRIM_HOME/haystacks/jargon.txt`` (``KVTRIM_HOME`` defaults to ``~/.cache/kvtrim``).
* A user file: ``"file:/path/to/text.txt"`` or a path to an existing file (UTF-8 text).

There is no silent fallback: if the jargon text cannot be provisioned, :class:`HaystackUnavailableError`
says what to run.

Sentence splitting (RULER uses NLTK punkt, whose data cannot be downloaded here) is done by
:func:`split_sentences`, a documented regular-expression splitter; results record it as
``SENTENCE_SPLITTER``.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvtrim.errors import HaystackUnavailableError, InvalidParameterError
from kvtrim.models import kvtrim_home

__all__ = [
    "BUILTIN_HAYSTACKS",
    "NOISE_BLOCK",
    "SENTENCE_SPLITTER",
    "HaystackUnavailableError",
    "clean_jargon_dict",
    "fetch_haystack",
    "get_haystack",
    "haystack_info",
    "kvtrim_home",
    "main",
    "split_sentences",
]

NOISE_BLOCK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's noise sentence block (also the Landmark/LongLoRA passkey garbage)."""

BUILTIN_HAYSTACKS: tuple[str, ...] = ("noise", "jargon")
"""Names accepted by :func:`get_haystack` besides file paths."""

SENTENCE_SPLITTER = "kvtrim-regex-v1"
"""Identifier of the sentence splitter (recorded in results instead of an NLTK punkt version)."""

_NOISE_REPEATS = 8192  # ~740k characters; consumers cycle the text when they need more.

_JARGON_PACKAGE = "dict-jargon"
_JARGON_DICT_MEMBER = "usr/share/dictd/jargon.dict.dz"
_JARGON_INSTALLED = Path("/usr/share/dictd/jargon.dict.dz")
_JARGON_MIN_WORDS = 20  # paragraphs shorter than this are cross-reference stubs ("See foo.")
_JARGON_FORMAT_VERSION = 2  # bump when clean_jargon_dict changes; invalidates the cache

_FETCH_HINT = (
    'Provision it with `python -c "from kvtrim.eval.haystacks import fetch_haystack; '
    "fetch_haystack('jargon')\"`, which runs `apt-get download dict-jargon` (no root needed when the apt "
    "package lists exist; as root it runs `apt-get update` first if needed, otherwise run "
    "`sudo apt-get update` once). Alternatively install the Debian/Ubuntu package `dict-jargon` "
    "(`sudo apt-get install dict-jargon`, which provides /usr/share/dictd/jargon.dict.dz), or pass your own "
    "prose as haystack='file:/path/to/text.txt'."
)


def _jargon_cache_path() -> Path:
    return kvtrim_home() / "haystacks" / "jargon.txt"


# --------------------------------------------------------------------------------------------------
# Sentence splitting
# --------------------------------------------------------------------------------------------------

# A sentence ends at '.', '!' or '?', optionally followed by closing quotes/brackets, when whitespace
# and then an upper-case letter, a digit or an opening quote/bracket follow.
_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*(?=\s+[\"'(\[\u201c\u2018]?[A-Z0-9])")
# A period after one of these words (or after a single letter, e.g. "J. Random Hacker") is not a
# sentence end.
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "cf", "fig", "no", "e.g", "i.e", "approx"}
)


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences with a regular expression (stand-in for NLTK punkt).

    Rule (``SENTENCE_SPLITTER = "kvtrim-regex-v1"``): a sentence ends after ``.``, ``!`` or ``?`` plus
    any closing quotes or brackets, when the next non-space character is an upper-case letter, a digit
    or an opening quote/bracket; a period directly after a single letter or a common abbreviation
    (Mr, Dr, e.g, i.e, ...) does not end a sentence. Sentences are stripped; empty ones are dropped.
    Joining the result with single spaces reproduces ``" ".join(text.split())``.
    """
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if text[match.start()] == ".":
            word = re.search(r"([A-Za-z.]+)$", text[start : match.start()])
            if word is not None:
                token = word.group(1).lower().lstrip(".")
                if len(token) == 1 or token in _ABBREVIATIONS:
                    continue
        piece = " ".join(text[start : match.end()].split())
        if piece:
            sentences.append(piece)
        start = match.end()
    tail = " ".join(text[start:].split())
    if tail:
        sentences.append(tail)
    return sentences


# --------------------------------------------------------------------------------------------------
# Jargon File provisioning
# --------------------------------------------------------------------------------------------------

_BOX_DRAWING = re.compile(r"[\u2500-\u257f]")
_ASCII_PUNCT = str.maketrans(
    {"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'", "\u2014": "--", "\u2013": "-", "\xad": ""}
)


def clean_jargon_dict(raw: str) -> str:
    """Turn the dictd source of the Jargon File into plain prose paragraphs (one per line).

    Keeps only definition text (lines indented by exactly four spaces; headwords, pronunciation lines,
    the ``00-database-*`` header entries, and deeper-indented verbatim blocks such as code, tables and
    ASCII art are dropped). Wrapped lines are joined, ``{cross reference}`` braces removed, typographic
    quotes and dashes mapped to ASCII, whitespace collapsed, and paragraphs with fewer than 20 words or
    with box-drawing characters discarded.
    """
    paragraphs: list[str] = []
    current: list[str] = []
    for line in raw.splitlines():
        if line.startswith("    ") and not line.startswith("     "):
            current.append(line.strip())
            continue
        if current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))

    cleaned: list[str] = []
    for paragraph in paragraphs:
        if _BOX_DRAWING.search(paragraph):
            continue
        text = paragraph
        previous = None
        while previous != text:  # nested references such as {{VAX}}
            previous, text = text, re.sub(r"\{\s*([^{}]*?)\s*\}", r"\1", text)
        text = re.sub(r"\u201c\s+", "\u201c", text)
        text = re.sub(r"\s+\u201d", "\u201d", text)
        text = " ".join(text.translate(_ASCII_PUNCT).split())
        if len(text.split()) >= _JARGON_MIN_WORDS:
            cleaned.append(text)
    return "\n".join(cleaned) + "\n"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False, timeout=600)


def _download_jargon_deb(workdir: Path) -> Path:
    """``apt-get download dict-jargon`` into ``workdir``; ``apt-get update`` first only if root needs it."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise HaystackUnavailableError(
            "Cannot provision the 'jargon' haystack: apt-get/dpkg-deb are not available on this machine. " + _FETCH_HINT
        )
    result = _run(["apt-get", "download", _JARGON_PACKAGE], workdir)
    if result.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
        update = _run(["apt-get", "update"], workdir)
        if update.returncode == 0:
            result = _run(["apt-get", "download", _JARGON_PACKAGE], workdir)
    debs = sorted(workdir.glob(f"{_JARGON_PACKAGE}_*.deb"))
    if result.returncode != 0 or not debs:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise HaystackUnavailableError(
            f"`apt-get download {_JARGON_PACKAGE}` failed ({' | '.join(detail) or 'no output'}). " + _FETCH_HINT
        )
    return debs[-1]


def _jargon_dict_bytes(workdir: Path) -> tuple[bytes, str]:
    """The gzip-compressed dictd text and a description of where it came from."""
    if _JARGON_INSTALLED.is_file():
        return _JARGON_INSTALLED.read_bytes(), f"installed package file {_JARGON_INSTALLED}"
    deb = _download_jargon_deb(workdir)
    extract_dir = workdir / "extract"
    result = _run(["dpkg-deb", "-x", str(deb), str(extract_dir)], workdir)
    member = extract_dir / _JARGON_DICT_MEMBER
    if result.returncode != 0 or not member.is_file():
        raise HaystackUnavailableError(
            f"`dpkg-deb -x {deb.name}` did not produce {_JARGON_DICT_MEMBER}: {result.stderr.strip()}. " + _FETCH_HINT
        )
    return member.read_bytes(), f"Debian package {deb.name} (apt-get download)"


def fetch_haystack(name: str, *, force: bool = False) -> Path:
    """Provision a downloadable haystack and return the path of its cached text.

    Only ``"jargon"`` needs provisioning. The cleaned text is written atomically to
    ``$KVTRIM_HOME/haystacks/jargon.txt`` together with ``jargon.json`` (provenance, sha256). An existing
    cache is reused unless ``force`` is true. Raises :class:`HaystackUnavailableError` with instructions
    when provisioning is impossible.
    """
    if name != "jargon":
        raise InvalidParameterError(
            f"fetch_haystack(name={name!r}): only 'jargon' can be fetched; 'noise' is built in and files "
            "are supplied by the user."
        )
    target = _jargon_cache_path()
    meta_path = target.with_suffix(".json")
    if target.is_file() and meta_path.is_file() and not force:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        if meta.get("format_version") == _JARGON_FORMAT_VERSION:
            return target
    with tempfile.TemporaryDirectory(prefix="kvtrim-jargon-") as tmp:
        compressed, source = _jargon_dict_bytes(Path(tmp))
    try:
        raw = gzip.decompress(compressed).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HaystackUnavailableError(f"Could not decompress jargon.dict.dz ({exc}). " + _FETCH_HINT) from exc
    text = clean_jargon_dict(raw)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(f".txt.tmp{os.getpid()}")
    tmp_target.write_text(text, encoding="utf-8")
    os.replace(tmp_target, target)
    meta = {
        "name": "jargon",
        "title": "The Jargon File, version 4.4.7 (29 Dec 2003)",
        "license": "public domain",
        "source": source,
        "format_version": _JARGON_FORMAT_VERSION,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "chars": len(text),
        "words": len(text.split()),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _read_text_cached.cache_clear()
    return target


# --------------------------------------------------------------------------------------------------
# Lookup
# --------------------------------------------------------------------------------------------------


def _resolve_file(name: str) -> Path | None:
    if name.startswith("file:"):
        return Path(name[len("file:") :]).expanduser()
    candidate = Path(name).expanduser()
    if name not in BUILTIN_HAYSTACKS and (candidate.suffix or os.sep in name) and candidate.exists():
        return candidate
    return None


@functools.lru_cache(maxsize=8)
def _read_text_cached(path: str, mtime_ns: int, size: int) -> str:
    return Path(path).read_text(encoding="utf-8")


def _read_text(path: Path) -> str:
    stat = path.stat()
    return _read_text_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def get_haystack(name: str) -> str:
    """Return the text of haystack ``name``: ``"noise"``, ``"jargon"``, ``"file:/path"`` or a file path.

    ``"jargon"`` is provisioned on first use (see :func:`fetch_haystack`); a missing file raises
    ``FileNotFoundError`` naming the ``haystack`` parameter.
    """
    if not isinstance(name, str) or not name:
        raise InvalidParameterError(f"haystack={name!r}: expected one of {BUILTIN_HAYSTACKS} or a file path.")
    if name == "noise":
        return "\n".join([NOISE_BLOCK] * _NOISE_REPEATS)
    if name == "jargon":
        return _read_text(fetch_haystack("jargon"))
    path = _resolve_file(name)
    if path is None:
        raise InvalidParameterError(
            f"haystack={name!r}: unknown haystack; use one of {BUILTIN_HAYSTACKS}, 'file:/path/to/text.txt' "
            "or the path of an existing text file."
        )
    if not path.is_file():
        raise FileNotFoundError(f"haystack={name!r}: file {path} does not exist.")
    text = _read_text(path)
    if not text.strip():
        raise InvalidParameterError(f"haystack={name!r}: file {path} is empty.")
    return text


def haystack_info(name: str) -> dict[str, object]:
    """Provenance of a haystack for results files: canonical name, source, sha256 and size."""
    text = get_haystack(name)
    info: dict[str, object] = {
        "name": name,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "chars": len(text),
        "sentence_splitter": SENTENCE_SPLITTER,
    }
    if name == "noise":
        info["source"] = "RULER noise block (built in)"
    elif name == "jargon":
        meta_path = _jargon_cache_path().with_suffix(".json")
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        info["source"] = f"{meta.get('title', 'The Jargon File 4.4.7')}; {meta.get('source', 'dict-jargon')}"
        info["license"] = "public domain"
    else:
        path = _resolve_file(name)
        info["name"] = f"file:{path.resolve() if path else name}"
        info["source"] = "user file"
    return info


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (for ``kvtrim``'s command line): ``[jargon] [--force]`` provisions the named haystacks
    and prints their cached paths; returns a process exit code."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    force = "--force" in args
    names = [a for a in args if a != "--force"] or ["jargon"]
    for name in names:
        try:
            path = fetch_haystack(name, force=force)
        except (HaystackUnavailableError, InvalidParameterError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(path)
    return 0
