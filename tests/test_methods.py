"""The method registry."""

from __future__ import annotations

import re

import pytest

import kvtrim
from kvtrim.methods import get_method, method_info, method_names


def test_registry_lists_foundation_methods_with_papers():
    names = method_names()
    for name in ["streaming_llm", "snapkv", "pyramidkv", "h2o", "knorm", "tova", "random"]:
        assert name in names
    listing = kvtrim.methods()
    for name in names:
        info = method_info(name)
        assert info.summary and info.preset
        assert name in listing
        if name != "random":  # an arXiv id, or the OpenReview page of a paper published there only (CaM)
            cited = r"arXiv \d{4}\.\d{5}|openreview\.net/forum\?id=\w+"
            assert re.search(cited, info.paper), name
            assert re.search(r"arXiv|openreview\.net", info.factory.__doc__ or ""), name


def test_parameter_override_and_defaults():
    pipe = get_method("snapkv", window=8, kernel=5, pooling="avg")
    assert pipe.scorer.window == 8 and pipe.observation.window == 8
    assert pipe.params == {"window": 8, "kernel": 5, "pooling": "avg"}
    assert method_info("pyramidkv").defaults()["beta"] == 20.0


def test_unknown_method_and_parameter():
    with pytest.raises(kvtrim.InvalidParameterError, match=r"valid methods: .*h2o.*snapkv"):
        get_method("snap")
    with pytest.raises(kvtrim.InvalidParameterError, match="has no parameter"):
        get_method("knorm", window=3)
