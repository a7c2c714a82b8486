"""Every tensor kvtrim makes while compressing and attending lands on the device of the data it meets.

The class of bug this guards (a factory call such as ``torch.arange(n)`` without ``device=``) only crashes on a
GPU, where the default device (CPU) differs from the model's. On a CPU-only machine the same bug is provoked by
making ``meta`` the default device while the model and its cache stay on the CPU: a device-less tensor is then a
meta tensor. Some ops quietly accept a meta operand next to CPU ones (``cpu.scatter_(..., meta_src)`` writes
garbage instead of raising), so a dispatch mode also checks that every aten op sees one device (0-dim CPU
scalars aside, as CUDA allows them too).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvtrim
from conftest import ARTIFACT_METHODS, QUESTION_WINDOW_PARAMS, RATIO_ONLY_METHODS, install_head_scores, tiny_model
from kvtrim.methods import method_names

CONTEXT = 160


class OneDevicePerOp(TorchDispatchMode):
    """Raise when an aten op gets tensors on more than one device (CPU 0-dim scalars excepted)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {
            t.device
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
        }
        if len(devices) > 1 and func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            raise RuntimeError(f"{func} mixes devices {sorted(str(d) for d in devices)}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def default_device(device: str):
    """Make ``device`` torch's default device, and check every op for mixed devices meanwhile."""
    torch.set_default_device(device)
    try:
        with OneDevicePerOp():
            yield
    finally:
        torch.set_default_device(None)


def _params(method: str) -> dict:
    if method in RATIO_ONLY_METHODS:  # small partitions: the prompt holds several, and decoding re-compresses
        return {"ratio": 0.75, "sink": 4, "lag": 16}
    if method == "compilerkv_elastic":  # a bare forward records no prompt log-probs for the perplexity bin
        return {"ratio": 0.75, "missing_logprobs": "median_bin"}
    if method == "full":
        return {}
    return {"ratio": 0.75, **QUESTION_WINDOW_PARAMS.get(method, {})}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


@pytest.mark.parametrize("method", ["full", *method_names()])
def test_compression_and_decode_make_no_default_device_tensors(model, method, monkeypatch, tmp_path):
    if method in ARTIFACT_METHODS:
        install_head_scores(model, monkeypatch, tmp_path)
    ids = torch.randint(3, 250, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    cache = kvtrim.make_cache(model, method, **_params(method))
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        entries_before, bytes_before = cache.stats().entries, cache.stats().kv_bytes
        next_ids = out.logits[:, -1:].argmax(-1)
        with default_device("meta"):
            for step in range(3):  # the first step compresses (auto_compress); later ones append (and may re-compress)
                position = torch.full((2, 1), CONTEXT + step, device="cpu")
                out = model(next_ids, past_key_values=cache, use_cache=True, position_ids=position)
                next_ids = out.logits[:, -1:].argmax(-1)
    assert out.logits.device.type == "cpu" and torch.isfinite(out.logits).all()
    if method != "full":
        assert cache.last_report is not None and not cache.last_report.skipped
        if method == "think":  # ThinK evicts no token: it stores thinner keys
            added = 3 * 2 * model.config.num_key_value_heads * model.config.num_hidden_layers  # 3 steps, 2 rows
            assert cache.stats().entries == entries_before + added
            assert cache.stats().kv_bytes < bytes_before
        else:
            assert 0 < cache.stats().entries < entries_before


def test_meta_default_device_catches_a_device_less_factory_call(model):
    """The harness above really fails for the bug class: LagKV's former ``torch.arange(lag)`` scattered into CPU
    ranks (which plain torch accepts silently with a meta source) raises."""
    data = torch.arange(4, device="cpu")
    with default_device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        torch.empty_like(data).scatter_(-1, data.argsort(), torch.arange(4).expand_as(data))
