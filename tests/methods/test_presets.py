"""Shared defaults are stated once, in kvtrim.methods.presets, and the paged engine reads them from there."""

from __future__ import annotations

import dataclasses

import pytest

from kvtrim.methods import method_info, method_names
from kvtrim.methods.presets import COMPRESSKV, KV_COMPRESS, LAGKV, SNAPKV


@pytest.mark.parametrize("name", sorted(KV_COMPRESS))
def test_kv_compress_methods_default_to_their_preset(name):
    preset = dataclasses.asdict(KV_COMPRESS[name])
    defaults = method_info(name).defaults()
    assert {k: v for k, v in preset.items() if k in defaults} == {k: defaults[k] for k in preset if k in defaults}
    # head_groups belongs to the pipeline (tensor-parallel splits), not to the presets the paged engine reads
    assert (set(defaults) - {"head_groups"}) | {"window"} == set(preset) and defaults["head_groups"] == 1
    assert method_info(name).factory().scorer.window == preset["window"]


def test_the_paged_engine_uses_the_registry_presets():
    from kvtrim.serve import engine

    assert engine.PAGED_METHODS is KV_COMPRESS
    assert KV_COMPRESS["kvc_w8"].protected_window == 8 and KV_COMPRESS["kvcompress"].protected_window == 32


def test_window_presets_are_shared():
    snap_like = {"snapkv", "pyramidkv", "adakv", "critical_snapkv", "critical_adakv", "headkv", "critical_headkv",
                 "think_snapkv"}  # fmt: skip
    for name in snap_like:
        d = method_info(name).defaults()
        assert (d["window"], d["kernel"], d["pooling"]) == (SNAPKV.window, SNAPKV.kernel, SNAPKV.pooling), name
    for name in [n for n in method_names() if "compresskv" in n]:
        d = method_info(name).defaults()
        assert (d["window"], d["kernel"], d["pooling"]) == (COMPRESSKV.window, COMPRESSKV.kernel, COMPRESSKV.pooling)
    for name in ("lagkv", "localkv", "lag_knorm"):
        d = method_info(name).defaults()
        assert (d["sink"], d["lag"]) == (LAGKV.sink, LAGKV.lag)
