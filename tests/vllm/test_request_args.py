"""A request's kvtrim settings in ``SamplingParams.extra_args`` (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.vllm.request_args import check_request, context_end, request_context_end

KEY = "kvtrim_context_tokens"


def test_without_settings_the_whole_prompt_is_compressed():
    for extra in (None, {}, {"other_plugin_x": 1}, {KEY: None}):
        assert context_end(extra, 700) == 700


def test_context_tokens_set_where_compression_happens():
    assert context_end({KEY: 600}, 700) == 600
    assert context_end({KEY: 700, "other_plugin_x": "y"}, 700) == 700  # the whole prompt: as without it


@pytest.mark.parametrize("bad", [0, -5, 701, 2.5, "600", True])
def test_context_tokens_outside_one_to_the_prompt_are_refused_naming_the_range(bad):
    with pytest.raises(InvalidParameterError, match=r"\['kvtrim_context_tokens'\] must be an integer in \[1, .*700\]"):
        context_end({KEY: bad}, 700)


def test_a_misspelt_kvtrim_setting_is_refused():
    with pytest.raises(InvalidParameterError, match=r"unknown kvtrim settings \['kvtrim_context'\]"):
        context_end({"kvtrim_context": 600}, 700)


def test_rounds_refuse_context_tokens_but_take_requests_without_them():
    with pytest.raises(InvalidParameterError, match="compresses in rounds"):
        check_request({KEY: 600}, 700, rounds=True)
    assert check_request(None, 700, rounds=True) == 700
    assert check_request({KEY: 600}, 700, rounds=False) == 600


def test_sampling_params_are_read_through_their_extra_args():
    assert request_context_end(SimpleNamespace(extra_args={KEY: 12}), 20) == 12
    assert request_context_end(SimpleNamespace(extra_args=None), 20) == 20
    assert request_context_end(None, 20) == 20  # a pooling request has no sampling parameters
