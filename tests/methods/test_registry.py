"""The registry: parameters recorded from the bound arguments, names, look-up, schedules."""

from __future__ import annotations

import inspect
import sys

import pytest

import kvtrim
from kvtrim.methods import get_method, method_info, method_names
from kvtrim.methods.registry import register, registered


@pytest.mark.parametrize("name", method_names())
def test_params_are_the_bound_arguments_with_defaults(name):
    info = method_info(name)
    pipe = get_method(name)
    assert pipe.name == name
    assert pipe.params == info.defaults()
    assert list(pipe.params) == list(inspect.signature(info.factory).parameters)  # every parameter, in order


def test_overrides_and_positional_calls_are_recorded_by_name():
    pipe = get_method("pyramidkv", window=4, beta=10.0)
    assert pipe.params == {"window": 4, "kernel": 7, "pooling": "max", "beta": 10.0}
    assert pipe.scorer.window == 4 and pipe.budget.beta == 10.0
    direct = method_info("adakv").factory(16, 5)  # the factory itself records its arguments too
    assert direct.name == "adakv"
    assert direct.params == {
        "window": 16, "kernel": 5, "pooling": "max", "alpha": 0.2, "rule": "official", "page_size": 1,
        "head_groups": 1,
    }


def test_a_method_built_from_another_gets_its_own_name_and_params():
    pipe = get_method("compresskv_trh", heads_per_layer=2)
    assert pipe.name == "compresskv_trh"
    assert pipe.scorer.ranking == "trh" and pipe.scorer.heads_per_layer == 2
    assert "heads" not in pipe.params and pipe.params["heads_per_layer"] == 2


def test_scheduled_name_and_params():
    pipe = get_method("snapkv@every:64", window=16)
    assert pipe.name == "snapkv@every:64" and pipe.schedule.continuous
    assert pipe.params == {"window": 16, "kernel": 7, "pooling": "max"}


def test_tail_schedule_needs_lag_partitions():
    assert get_method("lagkv@tail:32").schedule.lag == 32
    with pytest.raises(kvtrim.InvalidParameterError, match="lag-partition"):
        get_method("snapkv@tail:32")


def test_unknown_names_and_parameters_are_refused():
    with pytest.raises(kvtrim.InvalidParameterError, match="valid methods"):
        get_method("snapkv2")
    with pytest.raises(kvtrim.InvalidParameterError, match=r"has no parameter\(s\) \['windw'\]"):
        get_method("snapkv", windw=3)


def test_a_name_cannot_be_registered_twice():
    before = len(registered())
    with pytest.raises(ValueError, match="registered twice"):
        register("snapkv", family="x", summary="s", paper="p", preset="q")(lambda: None)
    assert len(registered()) == before


def test_every_method_has_a_family_module():
    from kvtrim.methods import FAMILIES

    families = {module.FAMILY for module in FAMILIES}
    assert {info.family for info in registered()} == families
    for info in registered():
        assert info.factory.__module__.rsplit(".", 1)[-1] in {m.__name__.rsplit(".", 1)[-1] for m in FAMILIES}


def test_family_modules_do_not_shadow_factories():
    package = sys.modules["kvtrim.methods"]  # the attribute kvtrim.methods is the listing function
    for name in method_names():
        assert not inspect.ismodule(getattr(package, name, None)), name
