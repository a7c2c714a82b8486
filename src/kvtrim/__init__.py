"""kvtrim: KV-cache compression for Hugging Face transformers models, measured honestly.

Quick start::

    import kvtrim
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    result = kvtrim.generate(model, tokenizer, context, "What is the pass key?", method="snapkv", ratio=0.5,
                             question_aware=True)
    print(result.answers[0], result.stats.kv_bytes_after)

The public names below are imported on first use, so ``import kvtrim`` (and the ``kvtrim`` command's start-up)
does not pay for torch and transformers until they are needed.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "GenerationStats": ".api",
    "Result": ".api",
    "Session": ".api",
    "compressing": ".api",
    "generate": ".api",
    "make_cache": ".api",
    "KVTrimCache": ".integration.cache",
    "get_attention_backend": ".cache.sdpa",
    "set_attention_backend": ".cache.sdpa",
    "BudgetSpec": ".compression.compressor",
    "InvalidParameterError": ".errors",
    "KVTrimError": ".errors",
    "MissingArtifactError": ".errors",
    "ModelNotAvailableError": ".errors",
    "UnsupportedModelError": ".errors",
    "get_method": ".methods",
    "method_names": ".methods",
    "methods": ".methods",
    "fetch_model": ".models",
    "kvtrim_home": ".models",
    "load_model": ".models",
    "load_tokenizer": ".models",
}

__all__ = [
    "BudgetSpec",
    "GenerationStats",
    "InvalidParameterError",
    "KVTrimCache",
    "KVTrimError",
    "MissingArtifactError",
    "ModelNotAvailableError",
    "Result",
    "Session",
    "UnsupportedModelError",
    "__version__",
    "compressing",
    "fetch_model",
    "generate",
    "get_attention_backend",
    "get_method",
    "kvtrim_home",
    "load_model",
    "load_tokenizer",
    "make_cache",
    "method_names",
    "methods",
    "set_attention_backend",
]


class _Package(types.ModuleType):
    """kvtrim's module type: importing the submodule ``kvtrim.methods`` must not replace the function
    ``kvtrim.methods()`` (the import system sets a package attribute for every submodule it loads)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtrim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .api import GenerationStats, Result, Session, compressing, generate, make_cache
    from .cache.sdpa import get_attention_backend, set_attention_backend
    from .compression.compressor import BudgetSpec
    from .errors import (
        InvalidParameterError,
        KVTrimError,
        MissingArtifactError,
        ModelNotAvailableError,
        UnsupportedModelError,
    )
    from .integration.cache import KVTrimCache
    from .methods import get_method, method_names, methods
    from .models import fetch_model, kvtrim_home, load_model, load_tokenizer
