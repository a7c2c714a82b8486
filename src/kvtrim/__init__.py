"""kvtrim: KV-cache compression for Hugging Face transformers models, measured honestly.

Quick start::

    import kvtrim
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    result = kvtrim.generate(model, tokenizer, context, "What is the pass key?", method="snapkv", ratio=0.5)
    print(result.answers[0], result.stats.kv_bytes_after)
"""

from .api import GenerationStats, Result, Session, compressing, generate, make_cache
from .cache.kvcache import KVTrimCache
from .cache.sdpa import get_attention_backend, set_attention_backend
from .compressor import BudgetSpec
from .errors import (
    InvalidParameterError,
    KVTrimError,
    MissingArtifactError,
    ModelNotAvailableError,
    UnsupportedModelError,
)
from .methods import get_method, method_names, methods
from .models import fetch_model, kvtrim_home, load_model, load_tokenizer

__version__ = "0.1.0"

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
