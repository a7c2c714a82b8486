"""Choosing a decode kernel trusts a call, not an import (kvtrim.cache.paged_kernels.choose_decode_kernel).

vLLM's flash-attention fork imports even when its compiled extension failed to load (it then sets
``FA2_AVAILABLE = False``), and any kernel may import and still fail on the device at hand. Fake kernel modules are
put into ``sys.modules`` here: one whose call raises, one whose flag says it is unavailable, one that returns a
wrong result. ``"auto"`` must skip each with the reason recorded; naming one must raise with that reason.
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

import paged_kernel_reference as ref
from conftest import byte_tokenizer, tiny_model
from kvtrim.cache import paged_kernels
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine

NO_IMAGE = "CUDA error: no kernel image is available for execution on the device"
MISSING_LIB = "libcudart.so.13: cannot open shared object file: No such file or directory"


@pytest.fixture(autouse=True)
def fresh_lookup(monkeypatch):
    """Forget cached lookups and test calls around every test; the CPU float32 pool passes the device checks."""

    def clear():
        for loader in (paged_kernels._load_vllm_fork, paged_kernels._load_flash_attn, paged_kernels._load_triton):
            loader.cache_clear()
        getattr(paged_kernels, "_PROBES", {}).clear()

    clear()
    monkeypatch.setattr(paged_kernels, "_device_supported", lambda device: True)
    monkeypatch.setattr(paged_kernels, "_dtype_supported", lambda dtype: True)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    yield
    clear()


def install_fork(monkeypatch, varlen, *, fa2_available: bool | None = None) -> list[int]:
    """Make ``vllm.vllm_flash_attn`` importable with ``varlen`` as its ``flash_attn_varlen_func`` (and, if given,
    its ``flash_attn_interface.FA2_AVAILABLE`` flag). Returns the list each call of ``varlen`` appends to."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return varlen(*args, **kwargs)

    vllm, package = ModuleType("vllm"), ModuleType("vllm.vllm_flash_attn")
    vllm.__path__, package.__path__ = [], []
    package.flash_attn_varlen_func = counted
    vllm.vllm_flash_attn = package
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", package)
    if fa2_available is not None:
        interface = ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
        interface.FA2_AVAILABLE = fa2_available
        interface.FA2_UNAVAILABLE_REASON = None if fa2_available else MISSING_LIB
        monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", interface)
    return calls


def install_upstream(monkeypatch, kvcache) -> None:
    module = ModuleType("flash_attn")
    module.flash_attn_with_kvcache = kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def raising(*args, **kwargs):
    raise RuntimeError(NO_IMAGE)


def zeros(q, *args, return_softmax_lse=False, **kwargs):
    """Runs, returns the right shapes, and the wrong numbers."""
    out = torch.zeros_like(q)
    return (out, torch.zeros(q.shape[1], q.shape[0])) if return_softmax_lse else out


KW = dict(device="cpu", dtype=torch.float32, head_dim=64)


@pytest.mark.parametrize("broken", ["raises", "flag", "wrong"])
def test_auto_skips_a_fork_that_imports_but_cannot_run(monkeypatch, broken):
    fake = {"raises": raising, "flag": ref.flash_attn_varlen_func, "wrong": zeros}[broken]
    calls = install_fork(monkeypatch, fake, fa2_available=False if broken == "flag" else None)
    assert paged_kernels.resolve_decode_kernel("auto", block_size=16, **KW) is None  # not the fork: gather
    install_upstream(monkeypatch, ref.flash_attn_with_kvcache)
    paged_kernels._load_flash_attn.cache_clear()
    assert paged_kernels.resolve_decode_kernel("auto", block_size=256, **KW).name == "flash_attn"
    if broken == "flag":
        assert not calls  # the flag alone rules it out: the kernel is never called


def test_a_working_fork_is_chosen_after_one_test_call(monkeypatch):
    calls = install_fork(monkeypatch, ref.flash_attn_varlen_func, fa2_available=True)
    assert paged_kernels.resolve_decode_kernel("auto", block_size=16, **KW).name == "vllm_flash_attn"
    assert len(calls) == 1
    assert paged_kernels.resolve_decode_kernel("flash", block_size=16, **KW).name == "vllm_flash_attn"
    assert len(calls) == 1  # cached per (implementation, device, dtype, block size, head dim)
    paged_kernels.resolve_decode_kernel("flash", block_size=32, **KW)
    assert len(calls) == 2  # another block size: another test call


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        ("raises", f"a test call raised RuntimeError: {NO_IMAGE}"),
        ("flag", f"FA2_AVAILABLE = False ({MISSING_LIB})"),
        ("wrong", "a test call returned a wrong output"),
    ],
)
def test_every_refusal_says_why(monkeypatch, broken, why):
    fake = {"raises": raising, "flag": ref.flash_attn_varlen_func, "wrong": zeros}[broken]
    install_fork(monkeypatch, fake, fa2_available=False if broken == "flag" else None)
    choice = paged_kernels.choose_decode_kernel("auto", block_size=16, **KW)
    refused = dict(choice.refused)
    assert choice.kernel is None and why in refused["vllm_flash_attn"], refused
    assert "flash_attn is not importable" in refused["flash_attn"]
    assert "needs a CUDA device" in refused["triton"]  # "auto" never runs Triton's interpreter
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='flash' cannot be used: .*vllm_flash_attn: ") as e:
        paged_kernels.resolve_decode_kernel("flash", block_size=16, **KW)
    assert why in str(e.value)
    # the engine says the same: which kernel runs, and why each other one does not
    model, tok = tiny_model("llama", heads=2, kv_heads=1, hidden=128), byte_tokenizer()  # head_dim 64
    engine = Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="auto")
    assert engine.stats.decode_kernel == "gather" and why in engine.stats.decode_kernel_refused["vllm_flash_attn"]
    with pytest.raises(InvalidParameterError, match="decode_kernel='flash' cannot be used") as e:
        Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="flash")
    assert why in str(e.value)


def test_gather_refuses_nothing_and_a_failed_triton_call_is_an_error(monkeypatch):
    assert paged_kernels.choose_decode_kernel("gather", block_size=16, **KW).refused == ()
    module = paged_kernels._load_triton()
    if module is None or not module.interpreter_on():
        pytest.skip("the Triton kernel runs here only under Triton's interpreter")
    monkeypatch.setattr(module, "paged_decode", raising)
    with pytest.raises(InvalidParameterError, match=f"'triton' cannot be used: a test call raised .*{NO_IMAGE}"):
        paged_kernels.resolve_decode_kernel("triton", block_size=16, **KW)
