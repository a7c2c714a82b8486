"""kvtrim's single SDPA entry point: backend selection on CUDA (mocked here), the override, and CPU unchanged."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import kvtrim
from conftest import tiny_model
from kvtrim.cache import sdpa as sdpa_mod
from kvtrim.errors import InvalidParameterError

SRC = pathlib.Path(kvtrim.__file__).parent


@pytest.fixture(autouse=True)
def _clean_override(monkeypatch):
    monkeypatch.delenv(sdpa_mod.ENV_VAR, raising=False)
    kvtrim.set_attention_backend(None)
    yield
    kvtrim.set_attention_backend(None)


def _qkv(b=2, hq=4, hkv=2, tq=3, s=7, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    return q, k, v


def _fake(device="cuda", dtype=torch.bfloat16, shape=(1, 32, 1, 128), kv_shape=(1, 8, 4096, 128)):
    """Stand-ins for CUDA tensors: ``plan`` only reads device, dtype and shape."""
    q = SimpleNamespace(device=torch.device(device), dtype=dtype, shape=shape)
    k = SimpleNamespace(device=torch.device(device), dtype=dtype, shape=kv_shape)
    return q, k


def test_auto_on_cuda_never_lists_cudnn_and_prefers_flash_then_efficient():
    assert sdpa_mod.sdpa_backends("auto") == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    for choice in ("auto", "flash_attn", "flash", "efficient", "math"):
        assert SDPBackend.CUDNN_ATTENTION not in sdpa_mod.sdpa_backends(choice)
    assert sdpa_mod.sdpa_backends("cudnn") == [SDPBackend.CUDNN_ATTENTION]


def test_plan_by_device_and_flash_attn_availability(monkeypatch):
    q, k = _fake()
    monkeypatch.setattr(sdpa_mod, "flash_attn_function", lambda: None)
    assert sdpa_mod.plan(q, k, None, False) == "sdpa"
    assert sdpa_mod.plan(*_fake(device="cpu"), None, False) == "default"
    assert sdpa_mod.plan(*_fake(device="meta"), None, False) == "default"
    monkeypatch.setattr(sdpa_mod, "flash_attn_function", lambda: object())
    assert sdpa_mod.plan(q, k, None, False) == "flash_attn"
    # what flash-attn cannot compute exactly goes to the restricted SDPA list
    assert sdpa_mod.plan(q, k, torch.ones(1, dtype=torch.bool), False) == "sdpa"  # explicit mask
    assert sdpa_mod.plan(*_fake(dtype=torch.float32), None, False) == "sdpa"  # fp32
    assert sdpa_mod.plan(*_fake(shape=(1, 32, 1, 100), kv_shape=(1, 8, 9, 100)), None, False) == "sdpa"
    assert sdpa_mod.plan(*_fake(shape=(1, 32, 512, 512), kv_shape=(1, 8, 512, 512)), None, False) == "sdpa"
    assert sdpa_mod.plan(q, k, None, True) == "sdpa"  # causal with q != s: alignments differ
    square = _fake(shape=(1, 32, 64, 128), kv_shape=(1, 8, 64, 128))
    assert sdpa_mod.plan(*square, None, True) == "flash_attn"
    for choice in ("flash", "efficient", "math", "cudnn"):  # an explicit SDPA backend is taken as asked
        kvtrim.set_attention_backend(choice)
        assert sdpa_mod.plan(q, k, None, False) == "sdpa"


def test_override_env_and_errors(monkeypatch):
    assert kvtrim.get_attention_backend() == "auto"
    monkeypatch.setenv(sdpa_mod.ENV_VAR, "Efficient")
    assert kvtrim.get_attention_backend() == "efficient"
    kvtrim.set_attention_backend("math")  # the function wins over the environment
    assert kvtrim.get_attention_backend() == "math"
    with pytest.raises(InvalidParameterError, match="auto, flash, efficient, math, cudnn, flash_attn"):
        kvtrim.set_attention_backend("fast")
    assert kvtrim.get_attention_backend() == "math"  # a rejected value changes nothing
    kvtrim.set_attention_backend(None)
    monkeypatch.setenv(sdpa_mod.ENV_VAR, "cudnn-ish")
    with pytest.raises(InvalidParameterError, match=sdpa_mod.ENV_VAR):
        kvtrim.get_attention_backend()


def test_flash_attn_choice_needs_the_package(monkeypatch):
    monkeypatch.setattr(sdpa_mod, "flash_attn_function", lambda: None)
    with pytest.raises(InvalidParameterError, match="flash-attn"):
        kvtrim.set_attention_backend("flash_attn")
    assert kvtrim.get_attention_backend() == "auto"
    monkeypatch.setattr(sdpa_mod, "flash_attn_function", lambda: object())
    kvtrim.set_attention_backend("flash_attn")
    assert kvtrim.get_attention_backend() == "flash_attn"


def test_cpu_calls_torch_sdpa_directly_without_a_backend_context(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("sdpa_kernel must not wrap CPU calls")

    monkeypatch.setattr(sdpa_mod, "sdpa_kernel", forbidden)
    kvtrim.set_attention_backend("cudnn")  # applies to CUDA only
    q, k, v = _qkv()
    mask = torch.rand(2, 2, 3, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    got = sdpa_mod.sdpa(q, k, v, is_causal=False, scale=0.5, enable_gqa=True)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True))
    kq = q.reshape(2, 2, 6, 16)
    m = mask[:, :, None].expand(2, 2, 2, 3, 7).reshape(2, 2, 6, 7)
    assert torch.equal(sdpa_mod.sdpa(kq, k, v, attn_mask=m), F.scaled_dot_product_attention(kq, k, v, attn_mask=m))


def test_cuda_path_enters_the_restricted_backend_list(monkeypatch):
    """The CUDA branch, run on CPU tensors by forcing the plan: it wraps SDPA in ``sdpa_kernel`` with the list of
    the choice in force (priority order kept), and computes the same attention."""
    seen = []
    real = sdpa_mod.sdpa_kernel

    def spy(backends, set_priority=False):
        seen.append((list(backends), set_priority))
        return real([b for b in backends if b != SDPBackend.EFFICIENT_ATTENTION], set_priority=set_priority)

    monkeypatch.setattr(sdpa_mod, "plan", lambda *a: "sdpa")
    monkeypatch.setattr(sdpa_mod, "sdpa_kernel", spy)
    q, k, v = _qkv()
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    got = sdpa_mod.sdpa(q, k, v, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, ref)
    assert seen == [(sdpa_mod.sdpa_backends("auto"), True)]
    kvtrim.set_attention_backend("math")
    torch.testing.assert_close(sdpa_mod.sdpa(q, k, v, scale=0.25, enable_gqa=True), ref)
    assert seen[-1] == ([SDPBackend.MATH], True)


def test_flash_attn_path_gets_seq_major_layout_and_native_gqa(monkeypatch):
    calls = []

    def fake_flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        # flash-attn's contract: [batch, seq, heads, head_dim], fewer KV heads than query heads allowed
        calls.append((tuple(q.shape), tuple(k.shape), softmax_scale, causal))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            scale=softmax_scale,
            is_causal=causal,
            enable_gqa=True,
        )
        return out.transpose(1, 2)

    monkeypatch.setattr(sdpa_mod, "flash_attn_function", lambda: fake_flash_attn_func)
    monkeypatch.setattr(sdpa_mod, "plan", lambda *a: "flash_attn")
    q, k, v = _qkv(tq=7)
    got = sdpa_mod.sdpa(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True))
    assert calls == [((2, 7, 4, 16), (2, 7, 2, 16), 0.3, True)]


def test_every_sdpa_call_in_kvtrim_goes_through_the_module():
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "scaled_dot_product_attention(" in p.read_text() and p.name != "sdpa.py"
    ]
    assert offenders == []


def test_full_method_attends_through_the_entry_point(monkeypatch):
    """kvtrim's full-cache decode (and every compressed method) attends through ``sdpa``: one call per layer."""
    from kvtrim.cache import attention, packed_attention

    calls = []
    real = attention.sdpa

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa", spy)  # fresh causal prefill
    monkeypatch.setattr(packed_attention, "backend_sdpa", spy)  # every store's masked / decoding attention
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with kvtrim.compressing(model, "full") as cache:
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, past_key_values=cache
        )
    assert torch.equal(out, ref)
    assert len(calls) == 2 * 4  # 2 layers x (prefill + 3 decode steps)
