"""Packing and unpacking of quantized KV entries (KIVI's layout): one job, no store logic.

* **Keys** are quantized per channel: a group of ``group_size`` consecutive tokens shares, for each channel, one
  scale and one zero point (``[..., tokens / group_size, head_dim]``). Key outliers live in fixed channels, so a
  per-channel range is tight.
* **Values** are quantized per token: each token's ``head_dim`` channels, in groups of ``value_group`` channels,
  share one scale and zero point (``[..., tokens, head_dim / value_group]``).
* Codes are asymmetric unsigned integers ``round((x - zero) / scale)`` in ``[0, 2**bits - 1]``; dequantized
  ``x ~ zero + code * scale``. Scales and zero points are float16, and codes are computed from the float16-rounded
  scale and zero point, so the error of an element is at most half a step plus the float16 rounding of ``zero``.
* ``int8``: one code per byte. ``int4``: two codes per byte along the last axis, the even channel in the low nibble
  and the odd channel in the high nibble (``byte = c[2i] | c[2i+1] << 4``); an odd number of channels (keys pruned
  to an odd count of channels, ThinK) ends with a byte whose high nibble is unused (zero).
* ``fp8``: float8 e4m3 (``torch.float8_e4m3fn``, largest finite value 448), symmetric: the same groups, a scale of
  ``max |x| / 448`` per group and a zero point of 0; the code byte is the float8 number's bit pattern (a uint8 view),
  so codes, scales and zero points keep the integer formats' shapes and every store holds them the same way. A code
  read back as a number is the float8 value (``x ~ code * scale``); the relative error of an element is at most
  2^-4 of its own magnitude (3 mantissa bits) above the float8 subnormal range.

* **Rotation** (``rotate``, off by default): keys and values are quantized as ``x @ R``, ``R`` a fixed orthogonal
  matrix (:func:`rotation`, a Hadamard transform with fixed random signs; QuaRot, arXiv 2404.00456). A channel
  carrying outliers (RoPE'd keys have several) then spreads over every channel of its Hadamard block, so the ranges
  a group shares narrow. Codes, scales and bytes keep their shapes; :func:`dequantize_keys` /
  :func:`dequantize_values` return the model's channels unless asked for the rotated basis, which attention reads
  with a rotated query (``q·k = (qR)·(kR)``) and an output rotated back (``p·V = (p·VR)Rᵀ``).

Packed bytes of one entry (key + value, per head): ``2 * head_dim * bits / 8``, plus its share of the scales:
``4 * head_dim / group_size`` (keys) and ``4 * head_dim / value_group`` (values), 4 = float16 scale + zero.
A store's full-precision window (``residual``, KIVI's ``R``) holds its newest entries in the model's dtype, and its
``sink`` oldest entries (the attention sinks, KVQuant's attention-sink-aware quantization) stay in the model's dtype
too, out of every key group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_RESIDUAL",
    "DEFAULT_ROTATE",
    "DEFAULT_SINK",
    "KV_QUANT_CHOICES",
    "SCALE_DTYPE",
    "KVQuant",
    "dequantize_keys",
    "dequantize_values",
    "pack_codes",
    "packed_width",
    "quantize_keys",
    "quantize_values",
    "resolve_kv_quant",
    "resolve_pool_kv_quant",
    "rotate",
    "rotation",
    "take_code_channels",
    "unpack_codes",
    "unpack_codes_as",
]

KV_QUANT_CHOICES = ("int8", "int4", "fp8")
SCALE_DTYPE = torch.float16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
_BITS = {"int8": 8, "int4": 4, "fp8": 8}
# Tokens per key group when none is given. int4 holds groups of 64 with a one-entry sink and rotation (below): that
# setting kept every retrieval row of the method sweeps within 3 points over 120 prompts (docs/quantization.md,
# "Rotation"), where groups of 32 without them lost up to 5.2, and it holds 1/28.6 of the float16 cache at ratio
# 0.875 (groups of 32: 1/27.2). 8-bit formats lose nothing at 64.
DEFAULT_GROUP_SIZE = {"int8": 64, "int4": 64, "fp8": 64}
# Full-precision entries kept after the last full key group when none is given (KIVI's R). int4 without a window
# lost 4.7 points on the full cache against float32 and 0.4 gained with 32 (docs/quantization.md, "Choosing the
# group size, the window and the sink"); 8-bit formats lose nothing measurable without one. A paged block pool has
# no window (resolve_pool_kv_quant).
DEFAULT_RESIDUAL = {"int8": 0, "int4": 32, "fp8": 0}
# Oldest entries of a row held in the model's dtype when none is given (KVQuant's attention sink): one for int4,
# whose first key would otherwise widen the first key group's range (with rotation it lowers int4's continuation KL
# by 45 % with groups of 64, docs/quantization.md, "The sink"); none for 8-bit formats, which lose nothing
# measurable without one. A paged block pool holds no full-precision entries (sink 0 always,
# resolve_pool_kv_quant).
DEFAULT_SINK = {"int8": 0, "int4": 1, "fp8": 0}
# Keys and values quantized in a rotated basis (a fixed orthogonal transform of the channels, below) when none is
# given: int4's (its continuation KL 33 % lower, and with the sink and groups of 64 the retrieval rows above); 8-bit
# formats lose nothing without it. A paged block pool keeps the same default (its int4 continuation KL 2.1x lower
# rotated, docs/quantization.md, "Rotation in the pool"); pass ``rotate=0`` for the model's channels
# (``"int4:rotate=0"``).
DEFAULT_ROTATE = {"int8": False, "int4": True, "fp8": False}
_MIN_SCALE = 1e-5  # a constant group (range 0) still gets a positive, float16-representable step


@dataclass(frozen=True)
class KVQuant:
    """How a store holds its entries.

    Attributes:
        name: ``"int8"``, ``"int4"`` or ``"fp8"``
        group_size: tokens per key group (one per-channel scale per group); the full-precision window is
            quantized a whole group at a time. Default (None): 64 (see ``DEFAULT_GROUP_SIZE``)
        residual: full-precision entries always kept after the last full group (KIVI's ``R``); the window holds
            between ``residual`` and ``residual + group_size - 1`` entries once that many exist. Default (None): 32
            for ``int4``, 0 for ``int8`` and ``fp8`` (see ``DEFAULT_RESIDUAL``); ``residual=0`` quantizes every
            full group
        value_group: channels per value group (None: the whole ``head_dim``, one scale per token)
        sink: the oldest entries of every row held in the model's dtype, outside every key group (attention sinks:
            KVQuant, Hooper et al. 2024, arXiv 2401.18079, keeps the first token in full precision; its outlier
            channels would otherwise widen the first key group's range, and nearly every query attends to it).
            Default (None): 1 for ``int4``, 0 for ``int8`` and ``fp8`` (see ``DEFAULT_SINK``)
        rotate: quantize keys and values in a rotated basis, ``x @ R`` with ``R`` a fixed orthogonal matrix
            (:func:`rotation`: a block-diagonal Hadamard transform with fixed random signs; QuaRot, Ashkboos et al.
            2024, arXiv 2404.00456): an outlier channel's magnitude is spread over every channel, so group ranges
            shrink. Attention never rotates the stored entries back: it rotates the query and the output instead
            (``q·k = (qR)·(kR)``, ``p·V = (p·VR)Rᵀ``). Default (None): on for ``int4``, off for ``int8`` and
            ``fp8`` (see ``DEFAULT_ROTATE``)
    """

    name: str
    group_size: int | None = None
    residual: int | None = None
    value_group: int | None = None
    sink: int | None = None
    rotate: bool | None = None

    def __post_init__(self):
        if self.name not in KV_QUANT_CHOICES:
            raise InvalidParameterError(f"kv_quant must be one of {KV_QUANT_CHOICES} or None, got {self.name!r}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE[self.name])
        if self.residual is None:
            object.__setattr__(self, "residual", DEFAULT_RESIDUAL[self.name])
        if self.sink is None:
            object.__setattr__(self, "sink", DEFAULT_SINK[self.name])
        if self.rotate is None:
            object.__setattr__(self, "rotate", DEFAULT_ROTATE[self.name])
        if self.rotate not in (True, False):  # 0 / 1 from a spec string
            raise InvalidParameterError(f"rotate must be 0 or 1 (False or True), got {self.rotate!r}")
        object.__setattr__(self, "rotate", bool(self.rotate))
        for field, value, low in (
            ("group_size", self.group_size, 1), ("residual", self.residual, 0), ("sink", self.sink, 0),
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{field} must be an integer >= {low}, got {value!r}")
        if self.value_group is not None and (
            isinstance(self.value_group, bool) or not isinstance(self.value_group, int) or self.value_group < 1
        ):
            raise InvalidParameterError(f"value_group must be a positive integer or None, got {self.value_group!r}")
        if self.bits == 4 and self.value_group is not None and self.value_group % 2:
            raise InvalidParameterError(
                f"value_group must be even for int4 (two codes per byte), got {self.value_group}"
            )

    @property
    def bits(self) -> int:
        return _BITS[self.name]

    @property
    def spec(self) -> str:
        """The format with every resolved setting, as :func:`resolve_kv_quant` reads it back: ``"int4:group_size=64,
        residual=32,sink=1,rotate=1"`` (``value_group`` only when set). What run records and command output name, so
        that a change of a default never makes two records with the same name hold differently quantized entries."""
        settings = [f"group_size={self.group_size}", f"residual={self.residual}"]
        if self.value_group is not None:
            settings.append(f"value_group={self.value_group}")
        settings.append(f"sink={self.sink}")
        settings.append(f"rotate={int(self.rotate)}")
        return f"{self.name}:{','.join(settings)}"

    @property
    def full_precision(self) -> tuple[str, int] | None:
        """``(field, value)`` of the first setting that keeps entries in the model's dtype (``residual``, then
        ``sink``), or None when every entry is packed: what a paged pool and its kernel cannot hold."""
        if self.residual:
            return "residual", self.residual
        if self.sink:
            return "sink", self.sink
        return None

    @property
    def is_float(self) -> bool:
        """Codes are float8 bit patterns (``fp8``), not unsigned integers."""
        return self.name == "fp8"

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def value_group_for(self, head_dim: int) -> int:
        """Channels per value group for ``head_dim`` (checked to divide it)."""
        g = head_dim if self.value_group is None else self.value_group
        if head_dim % g:
            raise InvalidParameterError(f"value_group={g} must divide head_dim={head_dim}")
        return g

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.codes_per_byte:
            raise InvalidParameterError(f"kv_quant={self.name!r} packs 2 codes per byte: head_dim must be even")
        self.value_group_for(head_dim)

    def entry_bytes(self, head_dim: int) -> float:
        """Bytes of one quantized entry (key + value of one head) including its share of the scales."""
        return (
            2 * head_dim * self.bits / 8
            + 4 * head_dim / self.group_size
            + 4 * head_dim / self.value_group_for(head_dim)
        )


_SPEC_FIELDS = ("group_size", "residual", "value_group", "sink", "rotate")


def resolve_kv_quant(
    kv_quant: str | KVQuant | None,
    *,
    default_group_size: int | None = None,
    default_residual: int | None = None,
    default_sink: int | None = None,
    default_rotate: bool | None = None,
) -> KVQuant | None:
    """``None``, a format name, a spec string or a :class:`KVQuant` -> a :class:`KVQuant` (or None).

    A spec string is a format name, optionally followed by ``:`` and comma-separated ``field=integer`` settings of
    :class:`KVQuant`: ``"int4"``, ``"int4:group_size=64"``, ``"int8:group_size=32,residual=32,value_group=32"``,
    ``"int4:residual=0"`` (what ``--kv-quant`` takes on the command line). A setting left out takes the format's
    default (``DEFAULT_GROUP_SIZE``, ``DEFAULT_RESIDUAL``, ``DEFAULT_SINK``, ``DEFAULT_ROTATE``), except that
    ``default_residual`` (not None) replaces
    the default window of a name or spec string that sets no ``residual``: a store without a window (the paged
    block pool) reads ``"int4"`` as ``residual=0``; ``default_sink`` does the same for ``sink`` (the pool holds no
    full-precision entries at all; a record written before the sink existed meant none) and ``default_rotate`` for
    ``rotate`` (a record written before rotation existed meant none), and
    ``default_group_size`` for ``group_size`` (a record written before every setting was spelled out). A
    :class:`KVQuant` is returned as it is.
    """
    if kv_quant is None or isinstance(kv_quant, KVQuant):
        return kv_quant
    if not isinstance(kv_quant, str):
        raise InvalidParameterError(f"kv_quant must be one of {KV_QUANT_CHOICES} or None, got {kv_quant!r}")
    name, sep, settings = kv_quant.partition(":")
    if name not in KV_QUANT_CHOICES:
        raise InvalidParameterError(f"kv_quant must be one of {KV_QUANT_CHOICES} or None, got {kv_quant!r}")
    fields: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in settings.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in _SPEC_FIELDS or key in fields:
            raise InvalidParameterError(
                f"kv_quant {kv_quant!r}: settings after ':' are field=integer with fields {_SPEC_FIELDS}, each once"
            )
        try:
            fields[key] = int(value)
        except ValueError:
            raise InvalidParameterError(f"kv_quant {kv_quant!r}: {key} must be an integer, got {value!r}") from None
    if sep and not fields:
        raise InvalidParameterError(f"kv_quant {kv_quant!r}: nothing after ':'; give field=integer settings")
    if default_group_size is not None:
        fields.setdefault("group_size", default_group_size)
    if default_residual is not None:
        fields.setdefault("residual", default_residual)
    if default_sink is not None:
        fields.setdefault("sink", default_sink)
    if default_rotate is not None:
        fields.setdefault("rotate", int(default_rotate))
    return KVQuant(name, **fields)


def resolve_pool_kv_quant(kv_quant: str | KVQuant | None) -> KVQuant | None:
    """``kv_quant`` as a paged block pool reads it (the engine's pool and its decode kernels): a name or spec string
    that sets no ``residual`` or ``sink`` means 0 (a pool packs every entry when it is written), ``rotate`` keeps the
    format's default (``DEFAULT_ROTATE``). A :class:`KVQuant` is returned as it is."""
    return resolve_kv_quant(kv_quant, default_residual=0, default_sink=0)


# ---------------------------------------------------------------------------------------------------- rotation
_ROTATION_SEED = 20240404  # fixed: codes written by one process must be read the same way by another
_rotations: dict[tuple[int, str], torch.Tensor] = {}


def rotation(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[d, d]`` float32 orthogonal ``R`` of :attr:`KVQuant.rotate`: ``diag(signs) · blockdiag(H, ..., H)``, with
    ``H`` the normalized Sylvester-Hadamard matrix of the largest power of two dividing ``d`` (``d`` itself for
    every power of two, e.g. 64 and 128; blocks of 16 for 80) and fixed random signs. A vector is rotated by
    ``x @ R`` and back by ``y @ R.T``. The same matrix for every layer and head; cached per ``(d, device)``."""
    key = (d, str(device))
    if key not in _rotations:
        n = d & -d  # the largest power of two dividing d
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(_ROTATION_SEED)) * 2.0 - 1.0
        r = signs.double()[:, None] * torch.block_diag(*[h / n**0.5] * (d // n))
        _rotations[key] = r.float().to(device)
    return _rotations[key]


def rotate(x: torch.Tensor, fmt: KVQuant | None, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[..., d]`` in the basis ``fmt`` quantizes in (``x @ R``; ``inverse``: back, ``x @ R.T``), in
    ``x``'s dtype, computed in float32; ``x`` itself when ``fmt`` does not rotate."""
    if fmt is None or not fmt.rotate:
        return x
    r = rotation(x.shape[-1], x.device)
    return (x.float() @ (r.T if inverse else r)).to(x.dtype)


def _unrotate_into(out: torch.Tensor, fmt: KVQuant, rotated: bool) -> torch.Tensor:
    """Dequantized entries ``out`` (in the rotated basis) brought back to the model's channels in place, unless
    ``rotated`` asks to leave them there."""
    if fmt.rotate and not rotated:
        out.copy_(rotate(out, fmt, inverse=True))
    return out


# ---------------------------------------------------------------------------------------------------- packing
def packed_width(d: int, bits: int) -> int:
    """Bytes that hold ``d`` codes of ``bits`` bits (``ceil(d * bits / 8)``)."""
    return -(-d * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., d]`` integer codes in ``[0, 2**bits)`` -> ``[..., ceil(d * bits / 8)]`` uint8 (an odd ``d`` at 4 bits
    leaves the last byte's high nibble zero)."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    low, high = codes[..., 0::2], codes[..., 1::2]
    if high.shape[-1] < low.shape[-1]:
        return torch.cat([low[..., :-1] | (high << 4), low[..., -1:]], dim=-1)
    return low | (high << 4)


def unpack_codes(packed: torch.Tensor, bits: int, width: int | None = None) -> torch.Tensor:
    """``[..., ceil(d * bits / 8)]`` uint8 -> ``[..., d]`` uint8 codes (inverse of :func:`pack_codes`; ``width`` =
    ``d``, None: every nibble)."""
    if bits == 8:
        return packed
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return codes if width is None else codes[..., :width]


def take_code_channels(packed: torch.Tensor, index: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """The packed codes of some channels: ``packed`` ``[..., ceil(width * bits / 8)]`` uint8 holding ``width``
    channels, ``index`` ``[..., k]`` (the same leading shape) the channels to take, in order -> ``[..., ceil(k * bits
    / 8)]`` uint8. Codes move unchanged (a per-channel key scale moves with its channel, so the entries they stand
    for are exactly the same)."""
    return pack_codes(torch.gather(unpack_codes(packed, bits, width), -1, index), bits)


def unpack_codes_as(
    packed: torch.Tensor, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None, *, fp8: bool = False
) -> torch.Tensor:
    """``[..., d * bits / 8]`` uint8 -> the codes as numbers ``[..., d]`` in ``dtype`` (written into ``out`` when
    given, whose last axis is then ``d``), in one pass: what a caller that applies the scales itself (after a
    matmul) multiplies with. ``fp8``: the bytes are float8 e4m3 numbers (:attr:`KVQuant.is_float`)."""
    return _codes_into(packed, bits, dtype, out, fp8)


def _affine(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 ``(scale, zero)`` for ranges ``[lo, hi]``."""
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    return scale, lo.to(SCALE_DTYPE)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x - zero.float()) / scale.float()).round_().clamp_(0, 2**bits - 1)


def _fp8_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 ``(scale, zero)`` of a symmetric float8 group whose largest magnitude is ``amax``."""
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    return scale, torch.zeros_like(scale)


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns of ``x / scale`` as float8 e4m3 (clamped to the finite range)."""
    return (x / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


# ---------------------------------------------------------------------------------------------------- values
def quantize_values(x: torch.Tensor, fmt: KVQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantization of values ``[..., n, d]`` (in the rotated basis when ``fmt.rotate``).

    Returns:
        codes ``[..., n, d * bits / 8]`` uint8, scale and zero ``[..., n, d / value_group]`` float16
    """
    d = x.shape[-1]
    g = fmt.value_group_for(d)
    xg = rotate(x.float(), fmt).unflatten(-1, (d // g, g))  # [..., n, groups, g]
    if fmt.is_float:
        scale, zero = _fp8_scale(xg.abs().amax(-1))
        return _fp8_codes(xg, scale[..., None]).flatten(-2), scale, zero
    scale, zero = _affine(xg.amin(-1), xg.amax(-1), fmt.bits)
    codes = _codes(xg, scale[..., None], zero[..., None], fmt.bits).flatten(-2)
    return pack_codes(codes, fmt.bits), scale, zero


def dequantize_values(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    fmt: KVQuant,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    rotated: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`quantize_values`: ``[..., n, d]`` in ``dtype`` (written into ``out`` when given).
    ``rotated``: leave them in the rotated basis of ``fmt.rotate`` (for attention that rotates its output back)."""
    out = _codes_into(codes, fmt.bits, dtype, out, fmt.is_float)
    groups = scale.shape[-1]
    grouped = out.unflatten(-1, (groups, out.shape[-1] // groups))
    grouped.mul_(scale.to(dtype)[..., None]).add_(zero.to(dtype)[..., None])
    return _unrotate_into(out, fmt, rotated)


def _codes_into(
    codes: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    fp8: bool = False,
    width: int | None = None,
) -> torch.Tensor:
    """The unpacked codes of ``codes`` ``[..., ceil(d * bits / 8)]`` written as numbers into ``out`` ``[..., d]`` (a
    new tensor of ``dtype`` when None; ``d`` is ``out``'s last axis, else ``width``, else every nibble). Writing in
    place, then scaling in place, is about 3x faster on CPU than converting the codes to a new tensor and combining
    them with ``addcmul``."""
    if out is not None:
        d = out.shape[-1]
    else:
        d = codes.shape[-1] * 8 // bits if width is None else width
        out = torch.empty((*codes.shape[:-1], d), dtype=dtype, device=codes.device)
    if fp8:
        out.copy_(codes.view(FP8_DTYPE))
    elif bits == 8:
        out.copy_(codes)
    else:
        out[..., 0::2].copy_(codes & 0xF)
        out[..., 1::2].copy_((codes >> 4)[..., : d // 2])
    return out


# ---------------------------------------------------------------------------------------------------- keys
def quantize_keys(
    x: torch.Tensor, fmt: KVQuant, valid: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel quantization of keys ``[..., n, d]`` in groups of ``group_size`` tokens (default
    ``fmt.group_size``; ``n`` a multiple). A store passes a smaller ``group_size`` for the one partial group a
    compaction leaves (``n`` tokens in one group).

    With ``fmt.rotate`` the keys are quantized in the rotated basis (``x @ R``, :func:`rotation`).

    ``valid`` ``[..., n]`` (optional) marks the tokens whose range counts: padding slots, never attended to, do not
    widen their group's steps (their own codes are clamped to the range of the others).

    Returns:
        codes ``[..., n, ceil(d * bits / 8)]`` uint8 (``d`` may be odd: keys pruned to some channels), scale and zero
        ``[..., n / group_size, d]`` float16
    """
    n, g = x.shape[-2], fmt.group_size if group_size is None else group_size
    if n % g:
        raise InvalidParameterError(f"keys to quantize must fill whole groups: {n} tokens, group_size={g}")
    xg = rotate(x.float(), fmt).unflatten(-2, (n // g, g))  # [..., groups, g, d]
    if fmt.is_float:
        mag = xg.abs() if valid is None else xg.abs().masked_fill(~valid.unflatten(-1, (n // g, g))[..., None], 0.0)
        scale, zero = _fp8_scale(mag.amax(-2))
        return _fp8_codes(xg, scale[..., None, :]).flatten(-3, -2), scale, zero
    if valid is None:
        lo, hi = xg.amin(-2), xg.amax(-2)
    else:
        invalid = ~valid.unflatten(-1, (n // g, g))[..., None]  # [..., groups, g, 1]
        lo = xg.masked_fill(invalid, float("inf")).amin(-2)
        hi = xg.masked_fill(invalid, float("-inf")).amax(-2)
        empty = torch.isinf(lo)  # a group of padding only
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    scale, zero = _affine(lo, hi, fmt.bits)
    codes = _codes(xg, scale[..., None, :], zero[..., None, :], fmt.bits).flatten(-3, -2)
    return pack_codes(codes, fmt.bits), scale, zero


def dequantize_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    fmt: KVQuant,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    rotated: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`: ``[..., n, d]`` in ``dtype`` (written into ``out`` when given; ``d`` is the
    scales' last axis). ``rotated``: leave them in the rotated basis of ``fmt.rotate`` (for attention that rotates
    its query instead)."""
    out = _codes_into(codes, fmt.bits, dtype, out, fmt.is_float, width=scale.shape[-1])
    groups = scale.shape[-2]
    grouped = out.unflatten(-2, (groups, out.shape[-2] // groups))
    grouped.mul_(scale.to(dtype)[..., None, :]).add_(zero.to(dtype)[..., None, :])
    return _unrotate_into(out, fmt, rotated)
