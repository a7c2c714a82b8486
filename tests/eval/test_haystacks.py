from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.errors import InvalidParameterError
from kvtrim.eval import haystacks
from kvtrim.eval.haystacks import (
    NOISE_BLOCK,
    HaystackUnavailableError,
    clean_jargon_dict,
    fetch_haystack,
    get_haystack,
    haystack_info,
    kvtrim_home,
    split_sentences,
)

from .conftest import jargon_provisioning_possible

FIXTURES = Path(__file__).parent / "fixtures"


def test_noise_haystack_is_ruler_block_per_line() -> None:
    text = get_haystack("noise")
    lines = text.split("\n")
    assert NOISE_BLOCK == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert len(lines) > 1000
    assert set(lines) == {NOISE_BLOCK}


def test_split_sentences_basic_rules() -> None:
    text = (
        'He said "stop." Then he left! Did it work? Yes. J. Random Hacker met Dr. Smith, e.g. at the lab. '
        "Version 2.5 shipped in 1999. 42 is the answer."
    )
    assert split_sentences(text) == [
        'He said "stop."',
        "Then he left!",
        "Did it work?",
        "Yes.",
        "J. Random Hacker met Dr. Smith, e.g. at the lab.",
        "Version 2.5 shipped in 1999.",
        "42 is the answer.",
    ]
    assert split_sentences("   ") == []
    assert split_sentences("no final period") == ["no final period"]


_PARTS = ["Alpha.", "beta", "Gamma!", "delta?", "Mr.", "X.", "9.", "'Quote.'", "\n", "  "]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_PARTS), max_size=40))
def test_split_sentences_preserves_words(parts: list[str]) -> None:
    text = " ".join(parts)
    assert " ".join(split_sentences(text)) == " ".join(text.split())


def test_clean_jargon_dict_keeps_only_prose() -> None:
    cleaned = clean_jargon_dict((FIXTURES / "jargon_sample.dict").read_text(encoding="utf-8"))
    paragraphs = cleaned.strip().split("\n")
    assert paragraphs == [
        'To manipulate or adjust, to tweak. Derived from frob. Usage: "Please frobnicate the knob until the '
        'reading settles" is the sort of thing one hears near a hardware bench late in the evening, when nobody '
        "remembers the manual.",
        "A meta-thing used to stand for a real object in didactic examples, especially database tutorials -- a "
        "placeholder that every student meets sooner or later while learning how to design a schema for an "
        "imaginary company that sells nothing in particular.",
    ]
    for junk in ("00-database", "frobnicate\n", "/frob", "header paragraph", "+------+", "{", "┌", "See frob."):
        assert junk not in cleaned


def test_file_haystack(tmp_path: Path) -> None:
    path = tmp_path / "story.txt"
    path.write_text("Once upon a time. The end.\n", encoding="utf-8")
    assert get_haystack(f"file:{path}") == "Once upon a time. The end.\n"
    assert get_haystack(str(path)) == "Once upon a time. The end.\n"
    info = haystack_info(f"file:{path}")
    assert info["name"] == f"file:{path.resolve()}"
    assert info["sha256"] == hashlib.sha256(b"Once upon a time. The end.\n").hexdigest()


def test_haystack_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="haystack="):
        get_haystack(f"file:{tmp_path / 'missing.txt'}")
    with pytest.raises(InvalidParameterError, match="unknown haystack"):
        get_haystack("paul_graham")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(InvalidParameterError, match="empty"):
        get_haystack(str(empty))
    with pytest.raises(InvalidParameterError, match="only 'jargon'"):
        fetch_haystack("noise")


def test_kvtrim_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))
    assert kvtrim_home() == tmp_path / "home"
    monkeypatch.delenv("KVTRIM_HOME")
    assert kvtrim_home() == Path("~/.cache/kvtrim").expanduser()


def test_unavailable_jargon_says_what_to_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    monkeypatch.setattr(haystacks, "_JARGON_INSTALLED", tmp_path / "not-installed.dict.dz")
    monkeypatch.setattr(haystacks.shutil, "which", lambda _name: None)
    with pytest.raises(HaystackUnavailableError) as excinfo:
        get_haystack("jargon")
    message = str(excinfo.value)
    assert "apt-get download dict-jargon" in message
    assert "file:" in message
    assert isinstance(excinfo.value, FileNotFoundError)


@pytest.mark.skipif(not jargon_provisioning_possible(), reason="no apt-get/dpkg-deb and dict-jargon not installed")
def test_fetch_jargon_into_fresh_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real provisioning path: apt-get download + dpkg-deb -x + clean + cache (about 1-2 s)."""
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    path = fetch_haystack("jargon")
    assert path == tmp_path / "haystacks" / "jargon.txt"
    text = path.read_text(encoding="utf-8")
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert meta["license"] == "public domain"
    assert len(text.split()) > 150_000
    assert "{" not in text and "00-database" not in text
    assert not any("\u2500" <= ch <= "\u257f" for ch in text)
    assert len(split_sentences(text[:20_000])) > 100
    mtime = path.stat().st_mtime_ns
    assert fetch_haystack("jargon") == path  # cached: not rebuilt
    assert path.stat().st_mtime_ns == mtime
    assert get_haystack("jargon") == text
    info = haystack_info("jargon")
    assert info["sha256"] == meta["sha256"] and "Jargon File" in str(info["source"])


def test_default_jargon_haystack_is_prose(jargon_text: str) -> None:
    sentences = split_sentences(jargon_text[:50_000])
    assert len(sentences) > 200
    words_per_sentence = sum(len(s.split()) for s in sentences) / len(sentences)
    assert 8 < words_per_sentence < 40


def test_cli_entry_point(capsys: pytest.CaptureFixture[str], jargon_text: str) -> None:
    assert haystacks.main(["jargon"]) == 0
    assert capsys.readouterr().out.strip().endswith("jargon.txt")
    assert haystacks.main(["noise"]) == 1
    assert "only 'jargon'" in capsys.readouterr().err
