"""The registry of named compression methods, one module per family.

Each method is a factory that composes a scorer, a budget allocator and a selector (and optionally a schedule and
key-channel pruning), registered with :func:`~kvtrim.methods.registry.register`; the defaults each follows are
named in its entry, the ones several methods share in :mod:`kvtrim.methods.presets`. Budgets count entries per
layer and KV head *including* protected windows.

Families: :mod:`.attention` (SnapKV, PyramidKV, AdaKV, H2O, TOVA), :mod:`.attention_free` (StreamingLLM, KNorm,
KeyDiff, random), :mod:`.lag` (LagKV), :mod:`.critical` (CriticalKV), :mod:`.head_budgets` (HeadKV, DuoAttention),
:mod:`.retrieval_heads` (CompressKV), :mod:`.compiled` (CompilerKV), :mod:`.kv_compress` (KV-Compress),
:mod:`.kvpress` (Expected Attention, ChunkKV, KVzip, CaM, KVgrad, key re-rotation …), :mod:`.calibrated`
(Q-Filters, LU-KV), :mod:`.reasoning` (R-KV,
TriAttention), :mod:`.channels` (ThinK). A family module's name never shadows a method's factory.
"""

from __future__ import annotations

# importing a family module registers its methods
from . import (
    attention,
    attention_free,
    calibrated,
    channels,
    compiled,
    critical,
    head_budgets,
    kv_compress,
    kvpress,
    lag,
    reasoning,
    retrieval_heads,
)
from .registry import (
    Capabilities,
    MethodInfo,
    capabilities_of,
    get_method,
    method_info,
    method_names,
    methods,
    register,
    split_schedule,
)

# the order of the families in listings and the README table
FAMILIES = (
    attention,
    attention_free,
    lag,
    critical,
    head_budgets,
    retrieval_heads,
    compiled,
    kv_compress,
    kvpress,
    calibrated,
    reasoning,
    channels,
)

__all__ = [
    "FAMILIES",
    "Capabilities",
    "MethodInfo",
    "attention",
    "attention_free",
    "capabilities_of",
    "channels",
    "compiled",
    "critical",
    "get_method",
    "head_budgets",
    "kv_compress",
    "kvpress",
    "lag",
    "method_info",
    "method_names",
    "methods",
    "reasoning",
    "register",
    "retrieval_heads",
    "split_schedule",
]
