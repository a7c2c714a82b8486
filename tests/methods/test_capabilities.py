"""Capabilities: declared by the parts' classes, derived per method."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.pipeline import Pipeline
from kvtrim.methods import capabilities_of, method_info, method_names
from kvtrim.methods.presets import KV_COMPRESS
from kvtrim.scoring.base import Scorer
from kvtrim.scoring.key_norm import KeyNormScorer
from kvtrim.selection.topk import TopKSelector

# the list kvtrim.vllm.config held by hand before the parts declared it (docs/vllm.md's table), plus pyramidkv
# (per-layer counts), adakv, critical_adakv, headkv, critical_headkv and duo_attention (per-head counts in one-head
# sub-pages) and critical_snapkv
VLLM_METHODS = {
    "streaming_llm",
    "snapkv",
    "tova",
    "knorm",
    "random",
    "lagkv",
    "localkv",
    "lag_knorm",
    "pyramidkv",
    "adakv",
    "critical_adakv",
    "critical_snapkv",
    "headkv",
    "critical_headkv",
    "duo_attention",
}


def _with(check) -> set[str]:
    return {n for n in method_names() if check(method_info(n).capabilities)}


def test_vllm_methods_are_the_ones_the_plugin_supported():
    assert _with(lambda c: c.vllm) == VLLM_METHODS
    from kvtrim.vllm.config import SUPPORTED_METHODS

    assert set(SUPPORTED_METHODS) == VLLM_METHODS


def test_paged_engine_methods_are_the_kv_compress_presets():
    assert _with(lambda c: c.paged_engine) == set(KV_COMPRESS)


def test_artifacts_come_from_the_parts():
    expect = {
        "headkv": ("headkv",),
        "critical_headkv": ("headkv",),
        "compresskv": ("compresskv",),
        "compresskv_srh_only": ("compresskv",),
        "ada_compresskv": ("compresskv",),
        "head_compresskv": ("compresskv", "headkv"),
        "duo_attention": ("duo",),
        "kvzap": ("kvzap",),
        "fastkvzip": ("fastkvzip",),
        "expected_attention_stats": ("expected_attention_stats",),
        "qfilter": ("qfilter",),
        "lukv": ("lukv",),
        "compilerkv": ("compilerkv",),
        "compilerkv_neutral": (),
        "compilerkv_neutral_elastic": (),
        "snapkv": (),
    }
    for name, kinds in expect.items():
        assert method_info(name).capabilities.artifacts == kinds, name
    assert _with(lambda c: bool(c.artifacts)) == {
        "headkv", "critical_headkv", "compresskv", "compresskv_srh_only", "compresskv_trh", "ada_compresskv",
        "head_compresskv", "duo_attention", "compilerkv", "compilerkv_elastic", "compilerkv_raw_attention",
        "compilerkv_static_threshold", "kvzap", "fastkvzip", "expected_attention_stats", "qfilter", "lukv",
    "restorekv",
    }  # fmt: skip


def test_budget_kinds():
    budgets = {n: method_info(n).capabilities.budgets for n in method_names()}
    assert budgets["snapkv"] == "uniform" and budgets["lagkv"] == "uniform"
    assert budgets["pyramidkv"] == "per layer" and budgets["compresskv"] == "per layer"
    per_head = {n for n, b in budgets.items() if b == "per head"}
    assert per_head == {
        "adakv", "critical_adakv", "headkv", "critical_headkv", "head_compresskv", "ada_compresskv",
        "duo_attention", "kvcompress", "kvc_w8", "kvc_full", "kvzip", "kvgrad", "dms", "fastkvzip", "lukv",
        "restorekv",
    }  # fmt: skip
    assert method_info("kvzip").capabilities.budgets == "per head"  # global threshold; layerwise=True is uniform
    from kvtrim.methods import get_method

    assert capabilities_of(get_method("kvzip", layerwise=True)).budgets == "uniform"


def test_attention_and_question_awareness():
    caps = {n: method_info(n).capabilities for n in method_names()}
    assert _with(lambda c: not c.attention) == {
        "streaming_llm", "knorm", "keydiff", "random", "lagkv", "localkv", "lag_knorm", "expected_attention",
        "duo_attention", "think", "curdkv", "leverage", "dms", "chunked", "block", "capkv", "merging", "triattention",
        "kvzap", "fastkvzip", "expected_attention_stats", "qfilter", "lukv",
    }  # fmt: skip
    assert caps["kvcompress"].question_aware and not caps["kvc_full"].question_aware  # KVC-full: every query
    assert caps["think"].question_aware  # the window queries choose the key channels
    assert not caps["h2o"].question_aware and not caps["kvzip"].question_aware


def test_schedules():
    caps = {n: method_info(n).capabilities for n in method_names()}
    assert caps["lagkv"].recursive and "tail" in caps["lagkv"].schedules
    assert caps["snapkv"].schedules == ("every", "over") and not caps["snapkv"].recursive
    assert caps["think"].schedules == () and caps["think_snapkv"].channels


def test_a_part_that_declares_nothing_is_an_error_not_a_default():
    @dataclass
    class Undeclared(Scorer):
        def score(self, view):
            raise AssertionError

    pipe = Pipeline("x", Undeclared(), UniformBudget(), TopKSelector())
    with pytest.raises(TypeError, match="Undeclared does not declare the capability 'uses_attention'"):
        capabilities_of(pipe)

    class BadBudget(UniformBudget):
        varies_by = "sometimes"

    with pytest.raises(TypeError, match="varies_by must be one of"):
        capabilities_of(Pipeline("x", KeyNormScorer(), BadBudget(), TopKSelector()))


def test_declarations_are_class_attributes_not_dataclass_fields():
    from dataclasses import fields

    for name in method_names():
        pipe = method_info(name).factory()
        for part in (pipe.scorer, pipe.budget, pipe.selector):
            names = {f.name for f in fields(part)}
            assert not names & {"uses_attention", "question_aware", "varies_by", "artifact_kind", "runs_in_vllm"}


def test_the_suites_hand_kept_method_sets_match_the_declared_capabilities():
    from conftest import ARTIFACT_METHODS, CHANNEL_METHODS, GLOBAL_BLOCK_METHODS, RECURSIVE_METHODS

    assert _with(lambda c: bool(c.artifacts)) == ARTIFACT_METHODS
    assert _with(lambda c: c.channels) == CHANNEL_METHODS
    assert _with(lambda c: c.paged_engine) == GLOBAL_BLOCK_METHODS
    assert _with(lambda c: c.recursive) == RECURSIVE_METHODS


def test_only_the_merging_methods_merge_values():
    assert _with(lambda c: c.merges) == {"merging", "cam"}
    assert "merges evicted values" in method_info("merging").capabilities.labels()
