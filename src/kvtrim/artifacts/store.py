"""Offline calibration artifacts: files keyed by the model's identity, versioned, loadable and inspectable.

An artifact of kind ``K`` for a model with key ``M`` (see :func:`model_key`) is two files in a directory
``<root>/M/``:

* ``K.safetensors``: the tensors (``safetensors.torch.save_file``);
* ``K.json``: metadata, with at least ``format_version``, ``kind``, ``model_key``, ``model_identity``,
  ``created_utc``, ``kvtrim_version``, ``settings`` (the calibration settings) and ``seconds`` (wall time).

:func:`load_artifact` searches, in order: an explicit ``path`` (a file or a directory); the kvtrim home
(``$KVTRIM_HOME/artifacts/M/``); the artifacts shipped inside the package (``kvtrim/data/artifacts/M/``).
When none exists it raises :class:`~kvtrim.errors.MissingArtifactError` naming the command that produces
it; there is no silent default. An artifact of an unknown format version, of another kind, or calibrated
on a different model (structure or weight fingerprint) is rejected with a :class:`ArtifactMismatchError`.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvtrim.errors import KVTrimError, MissingArtifactError
from kvtrim.models import EMBEDDED_MODELS, kvtrim_home

from .kinds import ARTIFACT_KINDS

__all__ = [
    "ARTIFACT_COMMANDS",
    "FORMAT_VERSION",
    "IDENTITY_FIELDS",
    "SUPPORTED_FORMAT_VERSIONS",
    "Artifact",
    "ArtifactMismatchError",
    "artifact_command",
    "default_artifact_dir",
    "describe_artifact",
    "load_artifact",
    "model_display_name",
    "model_identity",
    "model_key",
    "register_artifact_kind",
    "save_artifact",
    "shipped_artifact_dir",
]

FORMAT_VERSION = 1
"""Version written by :func:`save_artifact`; bump when the layout of the files changes."""

SUPPORTED_FORMAT_VERSIONS = frozenset({1})
"""Versions :func:`load_artifact` knows how to read."""

IDENTITY_FIELDS = (
    "model_type",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "fingerprint",
)
"""Fields of :func:`model_identity` that must match between an artifact and the model it is used with
(``name_or_path`` and ``fingerprint_tensors`` are informational)."""

ARTIFACT_COMMANDS: dict[str, tuple[str, str]] = ARTIFACT_KINDS
"""``kind -> (description, command template)`` (:data:`kvtrim.artifacts.kinds.ARTIFACT_KINDS`)."""

_FINGERPRINT_ROWS = 64


class ArtifactMismatchError(KVTrimError, ValueError):
    """An artifact exists but cannot be used: unknown format version, wrong kind, or another model."""


@dataclass
class Artifact:
    """A loaded artifact.

    Attributes:
        kind: what it holds (``"headkv"``, ...)
        tensors: name -> tensor (CPU)
        meta: the JSON metadata
        path: the ``.safetensors`` file it was read from
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path
    source: str = field(default="path")  # "path", "home" or "package"


def register_artifact_kind(kind: str, description: str, command: str) -> None:
    """Declare how artifacts of a kind kvtrim does not ship are produced (used in :class:`MissingArtifactError`
    messages); kvtrim's own kinds are in :data:`kvtrim.artifacts.kinds.ARTIFACT_KINDS`.

    ``command`` may contain ``{model}``, replaced by the model's display name.
    """
    ARTIFACT_COMMANDS[kind] = (description, command)


# ---------------------------------------------------------------------------------------------------- identity
def _config_value(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _fingerprint_params(model: torch.nn.Module, num_layers: int) -> list[tuple[str, torch.Tensor]]:
    """The weights hashed into the fingerprint: embedding rows 0..63, layer 0's q_proj, the last layer's
    o_proj and the final norm (falling back to the first and last 2-D parameters for unknown layouts)."""
    params = dict(model.named_parameters())
    chosen: list[tuple[str, torch.Tensor]] = []
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and getattr(embed, "weight", None) is not None:
        name = next((n for n, p in params.items() if p is embed.weight), "input_embeddings.weight")
        chosen.append((f"{name}[:{_FINGERPRINT_ROWS}]", embed.weight[:_FINGERPRINT_ROWS]))
    patterns = [
        r"(^|\.)layers\.0\.self_attn\.q_proj\.weight$",
        rf"(^|\.)layers\.{num_layers - 1}\.self_attn\.o_proj\.weight$",
        r"(^|\.)model\.norm\.weight$|^norm\.weight$",
    ]
    for pattern in patterns:
        name = next((n for n in params if re.search(pattern, n)), None)
        if name is not None:
            chosen.append((name, params[name]))
    if len(chosen) < 2:
        matrices = [(n, p) for n, p in params.items() if p.dim() == 2]
        if matrices:
            chosen.extend([matrices[0], matrices[-1]])
    return chosen


def _fingerprint(model: torch.nn.Module, num_layers: int) -> tuple[str, list[str]]:
    """SHA-256 over a few weight tensors cast to bfloat16 (so fp32 / bf16 loads of the same weights agree)."""
    digest = hashlib.sha256()
    names = []
    with torch.no_grad():
        for name, tensor in _fingerprint_params(model, num_layers):
            data = tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
            digest.update(name.encode())
            digest.update(str(tuple(data.shape)).encode())
            digest.update(data.numpy().tobytes())
            names.append(name)
    return digest.hexdigest(), names


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """Structure and weight fingerprint of ``model``.

    Returns a JSON-serialisable dict with ``model_type``, ``num_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``, ``name_or_path``,
    ``fingerprint`` (SHA-256 hex of a few weight tensors, see :func:`_fingerprint_params`) and
    ``fingerprint_tensors`` (their names).
    """
    config = _text_config(model)
    layers = int(_config_value(config, "num_hidden_layers", "n_layer"))
    heads = int(_config_value(config, "num_attention_heads", "n_head"))
    kv_heads = int(_config_value(config, "num_key_value_heads") or heads)
    hidden = int(_config_value(config, "hidden_size", "n_embd"))
    head_dim = int(_config_value(config, "head_dim") or hidden // heads)
    fingerprint, names = _fingerprint(model, layers)
    return {
        "model_type": str(getattr(config, "model_type", "unknown")),
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "vocab_size": int(_config_value(config, "vocab_size") or 0),
        "name_or_path": str(getattr(model.config, "name_or_path", "") or ""),
        "fingerprint": fingerprint,
        "fingerprint_tensors": names,
    }


def _key_from_identity(identity: dict[str, Any]) -> str:
    return (
        f"{identity['model_type']}-{identity['num_layers']}L-{identity['num_attention_heads']}H-"
        f"{identity['num_key_value_heads']}KV-{identity['fingerprint'][:12]}"
    )


def model_key(model: torch.nn.Module) -> str:
    """Directory name of ``model``'s artifacts, e.g. ``llama-30L-9H-3KV-1a2b3c4d5e6f``."""
    return _key_from_identity(model_identity(model))


def model_display_name(model: torch.nn.Module) -> str:
    """The name to pass to ``--model``: the embedded name when ``model`` was loaded from the kvtrim home,
    else ``name_or_path`` (``<model>`` when unknown)."""
    name = str(getattr(model.config, "name_or_path", "") or "")
    if not name:
        return "<model>"
    path = Path(name)
    for spec in EMBEDDED_MODELS.values():
        try:
            if path.resolve() == spec.directory.resolve():
                return spec.name
        except OSError:
            continue
    return name


def artifact_command(kind: str, model: torch.nn.Module | None = None) -> str:
    """The command that produces an artifact of ``kind`` for ``model``."""
    _, template = ARTIFACT_COMMANDS.get(kind, (kind, "kvtrim calibrate " + kind + " --model {model}"))
    return template.format(model=model_display_name(model) if model is not None else "<model>")


# ---------------------------------------------------------------------------------------------------- saving
def default_artifact_dir() -> Path:
    """``$KVTRIM_HOME/artifacts`` (``~/.cache/kvtrim/artifacts`` by default)."""
    return kvtrim_home() / "artifacts"


def _kvtrim_version() -> str:
    try:
        from importlib.metadata import version

        return version("kvtrim")
    except Exception:  # pragma: no cover - not installed as a distribution
        return "unknown"


def _check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", kind):
        raise ArtifactMismatchError(f"kind={kind!r}: use lower-case letters, digits, '_', '-' or '.'")


def save_artifact(
    kind: str,
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    directory: str | Path | None = None,
) -> Path:
    """Write ``<directory>/<model_key>/<kind>.safetensors`` and ``<kind>.json``; return the ``.safetensors`` path.

    Args:
        tensors: name -> tensor (moved to CPU and made contiguous)
        meta: JSON-serialisable metadata; ``settings`` (calibration settings) and ``seconds`` (wall time)
            are conventional. ``format_version``, ``kind``, ``model_key``, ``model_identity``,
            ``created_utc`` and ``kvtrim_version`` are filled in.
        directory: root directory (default :func:`default_artifact_dir`)
    """
    from safetensors.torch import save_file

    _check_kind(kind)
    identity = model_identity(model)
    key = _key_from_identity(identity)
    root = Path(directory) if directory is not None else default_artifact_dir()
    target = root / key
    target.mkdir(parents=True, exist_ok=True)
    payload = dict(meta)
    payload.update(
        {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "model_key": key,
            "model_identity": identity,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "kvtrim_version": _kvtrim_version(),
        }
    )
    payload.setdefault("settings", {})
    payload.setdefault("seconds", None)
    tensor_path = target / f"{kind}.safetensors"
    meta_path = target / f"{kind}.json"
    clean = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(clean, str(tensor_path), metadata={"kind": kind, "format_version": str(FORMAT_VERSION), "model_key": key})
    meta_path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    tensor_path.chmod(meta_path.stat().st_mode & 0o777)  # safetensors writes 0600; follow the umask like the JSON
    return tensor_path


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------------- loading
def shipped_artifact_dir() -> Path | None:
    """The package's ``kvtrim/data/artifacts`` directory when it is on the file system."""
    root = resources.files("kvtrim") / "data" / "artifacts"
    try:
        path = Path(str(root))
    except TypeError:  # pragma: no cover
        return None
    return path if path.is_dir() else None


def _pair(tensor_path: Path) -> tuple[Path, Path]:
    return tensor_path, tensor_path.with_suffix(".json")


def _explicit_candidates(path: Path, kind: str, key: str) -> list[Path]:
    if path.is_dir():
        return [path / f"{kind}.safetensors", path / key / f"{kind}.safetensors"]
    if path.suffix == ".json":
        return [path.with_suffix(".safetensors")]
    return [path]


@contextmanager
def _package_file(key: str, kind: str) -> Iterator[Path | None]:
    """The shipped ``<key>/<kind>.safetensors`` as a real file (extracted if the package is zipped)."""
    node = resources.files("kvtrim") / "data" / "artifacts" / key / f"{kind}.safetensors"
    if not node.is_file():
        yield None
        return
    with ExitStack() as stack:
        tensor_path = stack.enter_context(resources.as_file(node))
        meta_node = resources.files("kvtrim") / "data" / "artifacts" / key / f"{kind}.json"
        if meta_node.is_file():
            meta_path = stack.enter_context(resources.as_file(meta_node))
            if meta_path.parent != tensor_path.parent:  # zipped: both were extracted to temporary files
                yield _extracted_pair(tensor_path, meta_path)
                return
        yield tensor_path


def _extracted_pair(tensor_path: Path, meta_path: Path) -> Path:  # pragma: no cover - zipped installs only
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="kvtrim-artifact-"))
    shutil.copy(tensor_path, tmp / tensor_path.name)
    shutil.copy(meta_path, tmp / (tensor_path.stem + ".json"))
    return tmp / tensor_path.name


def _read(tensor_path: Path, kind: str, source: str) -> Artifact:
    from safetensors.torch import load_file

    _, meta_path = _pair(tensor_path)
    if not meta_path.is_file():
        raise ArtifactMismatchError(f"{tensor_path} has no metadata file {meta_path.name} next to it")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactMismatchError(f"cannot read artifact metadata {meta_path}: {exc}") from exc
    version = meta.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise ArtifactMismatchError(
            f"{meta_path}: format_version={version!r} is not one this kvtrim reads "
            f"({sorted(SUPPORTED_FORMAT_VERSIONS)}); re-run the calibration with this version"
        )
    if meta.get("kind") != kind:
        raise ArtifactMismatchError(f"{meta_path} holds a {meta.get('kind')!r} artifact, not {kind!r}")
    tensors = load_file(str(tensor_path))
    return Artifact(kind=kind, tensors=tensors, meta=meta, path=tensor_path, source=source)


def _check_identity(artifact: Artifact, identity: dict[str, Any], command: str) -> None:
    stored = artifact.meta.get("model_identity") or {}
    diffs = [f for f in IDENTITY_FIELDS if stored.get(f) != identity.get(f)]
    if diffs:
        detail = ", ".join(f"{f}: artifact {stored.get(f)!r} vs model {identity.get(f)!r}" for f in diffs)
        raise ArtifactMismatchError(
            f"{artifact.path} was calibrated on another model ({artifact.meta.get('model_key')}); "
            f"this model is {_key_from_identity(identity)} ({detail}). Run `{command}` for this model."
        )


def load_artifact(kind: str, model: torch.nn.Module, path: str | Path | None = None) -> Artifact:
    """Load the ``kind`` artifact of ``model``.

    Search order: ``path`` (a ``.safetensors``/``.json`` file, a ``<model_key>`` directory, or a root holding
    ``<model_key>/``); ``$KVTRIM_HOME/artifacts/<model_key>/``; the package's ``data/artifacts/<model_key>/``.

    Raises:
        MissingArtifactError: nothing found; the message names the command that produces it
        ArtifactMismatchError: unknown ``format_version``, another kind, or another model
    """
    _check_kind(kind)
    identity = model_identity(model)
    key = _key_from_identity(identity)
    command = artifact_command(kind, model)
    description = ARTIFACT_COMMANDS.get(kind, (f"{kind} artifact", ""))[0]
    if path is not None:
        explicit = Path(path).expanduser()
        for candidate in _explicit_candidates(explicit, kind, key):
            if candidate.is_file():
                artifact = _read(candidate, kind, "path")
                _check_identity(artifact, identity, command)
                return artifact
        raise MissingArtifactError(
            f"no {description} for model {key} at {explicit} (looked for {kind}.safetensors there); "
            f"run `{command}` to produce it"
        )
    home_file = default_artifact_dir() / key / f"{kind}.safetensors"
    if home_file.is_file():
        artifact = _read(home_file, kind, "home")
        _check_identity(artifact, identity, command)
        return artifact
    with _package_file(key, kind) as shipped:
        if shipped is not None:
            artifact = _read(shipped, kind, "package")
            _check_identity(artifact, identity, command)
            return artifact
    raise MissingArtifactError(
        f"no {description} for model {key} (searched {home_file.parent} and the artifacts shipped with "
        f"kvtrim); run `{command}`"
    )


# ---------------------------------------------------------------------------------------------------- describing
def _tensor_line(name: str, tensor: torch.Tensor) -> str:
    shape = "x".join(str(s) for s in tensor.shape) or "scalar"
    line = f"  {name}: {shape} {str(tensor.dtype).replace('torch.', '')}"
    if tensor.numel() and (tensor.is_floating_point() or tensor.dtype == torch.bool):
        t = tensor.double()
        line += f"  min {t.min().item():.4g}  mean {t.mean().item():.4g}  max {t.max().item():.4g}"
    return line


def _top_entries(tensor: torch.Tensor, k: int = 8) -> str:
    flat = tensor.double().flatten()
    k = min(k, flat.numel())
    values, idx = flat.topk(k)
    cols = tensor.shape[1]
    return ", ".join(f"{i // cols}.{i % cols}={v:.3g}" for v, i in zip(values.tolist(), idx.tolist(), strict=True))


def describe_artifact(artifact: Artifact) -> str:
    """A human-readable summary: where it came from, the model, settings, summary numbers and tensors."""
    meta = artifact.meta
    identity = meta.get("model_identity", {})
    lines = [
        f"{artifact.kind} artifact  (format {meta.get('format_version')}, kvtrim {meta.get('kvtrim_version')})",
        f"  file:    {artifact.path}  [{artifact.source}]",
        f"  model:   {meta.get('model_key')}  ({identity.get('name_or_path') or 'unnamed'}; "
        f"{identity.get('num_layers')} layers, {identity.get('num_attention_heads')} query / "
        f"{identity.get('num_key_value_heads')} KV heads, head_dim {identity.get('head_dim')})",
        f"  created: {meta.get('created_utc')}",
    ]
    seconds = meta.get("seconds")
    if isinstance(seconds, (int, float)):
        lines.append(f"  wall time: {seconds:.1f} s")
    for label in ("summary", "settings"):
        block = meta.get(label)
        if isinstance(block, dict) and block:
            lines.append(f"  {label}:")
            for name, value in block.items():
                text = json.dumps(value, default=_json_default)
                lines.append(f"    {name}: {text if len(text) <= 100 else text[:97] + '...'}")
    lines.append("  tensors:")
    for name, tensor in artifact.tensors.items():
        lines.append(_tensor_line(name, tensor))
    for name, tensor in artifact.tensors.items():
        if tensor.dim() == 2 and tensor.is_floating_point() and tensor.numel():
            lines.append(f"  top {name} (layer.head=value): {_top_entries(tensor)}")
    return "\n".join(lines)
