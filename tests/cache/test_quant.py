"""Packing and unpacking of quantized KV entries (kvtrim.cache.quant) on hand-made tensors."""

import pytest
import torch

from kvtrim.cache.quant import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_RESIDUAL,
    DEFAULT_SINK,
    KV_QUANT_CHOICES,
    KVQuant,
    dequantize_keys,
    dequantize_values,
    pack_codes,
    quantize_keys,
    quantize_values,
    resolve_kv_quant,
    unpack_codes,
)
from kvtrim.errors import InvalidParameterError


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 3 + 1


def test_int4_packing_order_low_nibble_is_even_channel():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[1 | (2 << 4), 15, 7 | (9 << 4)]]
    assert torch.equal(unpack_codes(packed, 4), codes)
    assert torch.equal(pack_codes(codes, 8), codes)


@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4)])
def test_value_round_trip_error_is_at_most_half_a_step(name, bits):
    fmt = KVQuant(name, value_group=16, rotate=False)  # the half-step bound holds in the basis quantized
    x = _x(2, 3, 10, 64)
    codes, scale, zero = quantize_values(x, fmt)
    assert codes.shape == (2, 3, 10, 64 * bits // 8) and codes.dtype == torch.uint8
    assert scale.shape == zero.shape == (2, 3, 10, 4) and scale.dtype == torch.float16
    back = dequantize_values(codes, scale, zero, fmt, torch.float32)
    step = scale.float().repeat_interleave(16, dim=-1)
    slack = zero.float().abs().repeat_interleave(16, dim=-1) * 2**-10  # float16 rounding of the zero point
    assert ((back - x).abs() <= step / 2 * 1.001 + slack + 1e-6).all()
    # the range is really used: the error is far below the data's spread
    assert (back - x).abs().max() < (0.05 if bits == 8 else 0.8)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_key_round_trip_error_per_channel_group(name):
    fmt = KVQuant(name, group_size=8, rotate=False)
    x = _x(1, 2, 24, 16)
    x[..., 3] *= 50  # an outlier channel does not widen the other channels' steps
    codes, scale, zero = quantize_keys(x, fmt)
    assert scale.shape == (1, 2, 3, 16)
    back = dequantize_keys(codes, scale, zero, fmt, torch.float32)
    step = scale.float().repeat_interleave(8, dim=-2)
    slack = zero.float().abs().repeat_interleave(8, dim=-2) * 2**-10
    assert ((back - x).abs() <= step / 2 * 1.001 + slack + 1e-6).all()
    assert scale[..., 3].float().min() > 10 * scale[..., 0].float().max()


def test_key_groups_do_not_mix_tokens_across_a_boundary():
    fmt = KVQuant("int8", group_size=4)
    x = torch.zeros(1, 1, 8, 2)
    x[..., 4:, :] = 1000.0  # the second group alone holds large values
    x[..., :4, 0] = torch.tensor([0.0, 0.1, 0.2, 0.3])
    codes, scale, zero = quantize_keys(x, fmt)
    back = dequantize_keys(codes, scale, zero, fmt, torch.float32)
    assert (back[..., :4, 0] - x[..., :4, 0]).abs().max() < 1e-3  # not widened by the second group
    with pytest.raises(InvalidParameterError, match="group_size"):
        quantize_keys(x[..., :6, :], fmt)


def test_constant_group_is_exact():
    fmt = KVQuant("int4", group_size=4, rotate=False)
    x = torch.full((1, 1, 4, 8), 2.5)
    back = dequantize_keys(*quantize_keys(x, fmt), fmt, torch.float32)
    assert torch.equal(back, x)
    back_v = dequantize_values(*quantize_values(x, fmt), fmt, torch.float32)
    assert torch.equal(back_v, x)


def test_entry_bytes_formula():
    assert KVQuant("int4", group_size=64).entry_bytes(64) == 64 + 4 + 4
    assert KVQuant("int8", group_size=32, value_group=32).entry_bytes(64) == 128 + 8 + 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "int3"}, "kv_quant"),
        ({"name": "int8", "group_size": 0}, "group_size"),
        ({"name": "int8", "residual": -1}, "residual"),
        ({"name": "int8", "value_group": 0}, "value_group"),
        ({"name": "int4", "value_group": 3}, "value_group"),
    ],
)
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        KVQuant(**kwargs)


def test_resolve_kv_quant():
    assert resolve_kv_quant(None) is None
    assert resolve_kv_quant("int4") == KVQuant("int4")
    assert KVQuant("int4") == KVQuant("int4", group_size=64, residual=32, sink=1, rotate=True)
    assert resolve_kv_quant("fp8") == KVQuant("fp8")
    with pytest.raises(InvalidParameterError, match=r"kv_quant must be one of \('int8', 'int4', 'fp8'\)"):
        resolve_kv_quant("fp4")
    with pytest.raises(InvalidParameterError, match="value_group=24 must divide head_dim=64"):
        KVQuant("int8", value_group=24).check_head_dim(64)
    with pytest.raises(InvalidParameterError, match="head_dim must be even"):
        KVQuant("int4").check_head_dim(63)


def test_default_group_sizes():
    assert KVQuant("int4").group_size == 64 and KVQuant("int8").group_size == 64 and KVQuant("fp8").group_size == 64
    assert KVQuant("int4", group_size=32).group_size == 32


def test_default_residual_windows_come_from_one_table():
    """int4 keeps a 32-entry full-precision window (KIVI's R) by default, 8-bit formats none; int4 alone has a
    one-entry sink; an explicit ``residual=0`` stays 0 and a given setting is kept as given."""
    assert DEFAULT_RESIDUAL == {"int8": 0, "int4": 32, "fp8": 0}
    assert DEFAULT_SINK == {"int8": 0, "int4": 1, "fp8": 0}
    assert set(DEFAULT_RESIDUAL) == set(DEFAULT_GROUP_SIZE) == set(DEFAULT_SINK) == set(KV_QUANT_CHOICES)
    for name in KV_QUANT_CHOICES:
        assert KVQuant(name).residual == DEFAULT_RESIDUAL[name]
        assert KVQuant(name).group_size == DEFAULT_GROUP_SIZE[name]
        assert KVQuant(name).sink == DEFAULT_SINK[name]
    assert KVQuant("int4", sink=1).sink == 1 and KVQuant("int8", sink=2).sink == 2
    assert KVQuant("int4", residual=0).residual == 0
    assert KVQuant("int4", group_size=64).residual == 32
    assert KVQuant("int8", residual=16).residual == 16
    assert resolve_kv_quant("int4:residual=0") == KVQuant("int4", residual=0) != KVQuant("int4")
    assert resolve_kv_quant("int4:group_size=64").residual == 32
    assert repr(KVQuant("int4")) == (
        "KVQuant(name='int4', group_size=64, residual=32, value_group=None, sink=1, rotate=True)"
    )


def test_spec_names_every_resolved_setting_and_reads_back():
    assert KVQuant("int4").spec == "int4:group_size=64,residual=32,sink=1,rotate=1"
    assert KVQuant("int8").spec == "int8:group_size=64,residual=0,sink=0,rotate=0"
    assert KVQuant("int4", residual=0, value_group=32, rotate=False).spec == (
        "int4:group_size=64,residual=0,value_group=32,sink=1,rotate=0"
    )
    for fmt in (
        KVQuant("int4"), KVQuant("int4", rotate=False, sink=0), KVQuant("fp8", group_size=16, residual=8),
        KVQuant("int8", value_group=16), KVQuant("int8", rotate=True),
    ):  # fmt: skip
        assert resolve_kv_quant(fmt.spec) == fmt


def test_default_residual_replaces_only_the_window_a_string_leaves_out():
    """What a store without a window (the paged block pool) reads: a name means no window, a given one is kept
    (the pool then refuses it), and a KVQuant is returned as it is."""
    assert resolve_kv_quant("int4", default_residual=0) == KVQuant("int4", residual=0)
    assert resolve_kv_quant("int4:group_size=64", default_residual=0) == KVQuant("int4", group_size=64, residual=0)
    assert resolve_kv_quant("int4:residual=16", default_residual=0).residual == 16
    assert resolve_kv_quant(KVQuant("int4"), default_residual=0).residual == 32
    assert resolve_kv_quant(None, default_residual=0) is None


def test_resolve_kv_quant_spec_strings():
    assert resolve_kv_quant("int4:group_size=64") == KVQuant("int4", group_size=64)
    assert resolve_kv_quant("int8: group_size=32, residual=16,value_group=32") == KVQuant(
        "int8", group_size=32, residual=16, value_group=32
    )
    for bad, match in [
        ("int4:", "nothing after ':'"),
        ("int4:size=3", "fields \\('group_size', 'residual', 'value_group', 'sink', 'rotate'\\), each once"),
        ("int4:residual=1,residual=2", "each once"),
        ("int4:group_size=x", "group_size must be an integer, got 'x'"),
        ("int4:group_size=0", "group_size must be an integer >= 1"),
        ("int3:group_size=32", "kv_quant must be one of"),
    ]:
        with pytest.raises(InvalidParameterError, match=match):
            resolve_kv_quant(bad)


def test_padding_does_not_widen_key_steps():
    fmt = KVQuant("int8", group_size=4)
    x = _x(1, 1, 8, 4)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    padded = x.clone()
    padded[..., 0, :] = 1e4  # a padding slot with a wild key
    valid[..., 0] = False
    valid[..., 4:] = False  # a group of padding only
    _, scale, zero = quantize_keys(padded, fmt, valid)
    _, ref_scale, ref_zero = quantize_keys(x[..., 1:4, :].repeat(1, 1, 2, 1)[..., :4, :], fmt)
    assert torch.equal(scale[..., 0, :], ref_scale[..., 0, :]) and torch.equal(zero[..., 0, :], ref_zero[..., 0, :])
    assert torch.isfinite(scale).all() and (zero[..., 1, :] == 0).all()
    _, wide, _ = quantize_keys(padded, fmt)
    assert (wide[..., 0, :].float() > 30).all()  # without the mask the wild key sets the step


# ---------------------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("which", ["keys", "values"])
def test_fp8_round_trip_error_is_relative_to_each_element(which):
    """e4m3 keeps 3 mantissa bits: an element's error is at most 2^-4 of itself once it is above the subnormal
    range of its group's scale (the group's largest magnitude maps to 448)."""
    fmt = KVQuant("fp8", group_size=16)
    x = _x(2, 3, 32, 16)
    if which == "keys":
        codes, scale, zero = quantize_keys(x, fmt)
        back = dequantize_keys(codes, scale, zero, fmt, torch.float32)
        step = scale.float().repeat_interleave(16, dim=-2)  # per (group, channel)
    else:
        codes, scale, zero = quantize_values(x, fmt)
        back = dequantize_values(codes, scale, zero, fmt, torch.float32)
        step = scale.float().expand_as(x)  # one scale per token
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and (zero == 0).all()
    normal = x.abs() >= step * 2**-6  # e4m3's smallest normal number is 2^-6
    err = (back - x).abs()
    assert (err[normal] <= x.abs()[normal] * 2**-4 + 1e-6).all()
    assert (err[~normal] <= step[~normal] * 2**-10 + 1e-6).all()  # subnormals: steps of 2^-9, half a step
    # the code byte is the float8 number itself: read back as numbers it is x / scale
    as_numbers = codes.view(torch.float8_e4m3fn).float()
    assert (as_numbers.abs() <= 448).all() and as_numbers.abs().amax() == 448


def test_fp8_entry_bytes_equal_int8s_and_padding_does_not_widen_the_scale():
    assert KVQuant("fp8").entry_bytes(64) == KVQuant("int8").entry_bytes(64)
    fmt = KVQuant("fp8", group_size=4)
    x = _x(1, 1, 4, 4)
    padded, valid = x.clone(), torch.ones(1, 1, 4, dtype=torch.bool)
    padded[..., 0, :], valid[..., 0] = 1e4, False
    _, scale, _ = quantize_keys(padded, fmt, valid)
    _, ref, _ = quantize_keys(x[..., 1:, :].repeat(1, 1, 2, 1)[..., :4, :], fmt)
    assert torch.equal(scale, ref)
