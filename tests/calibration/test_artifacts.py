"""Calibration artifacts: identity keys, round trips, search order and rejection of foreign artifacts."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from kvtrim.artifacts.store import (
    ArtifactMismatchError,
    describe_artifact,
    load_artifact,
    model_identity,
    model_key,
    save_artifact,
)
from kvtrim.errors import MissingArtifactError


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("KVTRIM_HOME", str(home))
    return home


def test_model_key_stable_across_loads_and_sensitive_to_weights(tmp_path):
    a, b = tiny_model("llama", 3, 4, 2, seed=0), tiny_model("llama", 3, 4, 2, seed=0)
    key = model_key(a)
    assert key == model_key(b)
    assert key.startswith("llama-3L-4H-2KV-") and len(key.split("-")[-1]) == 12
    a.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model_key(reloaded) == key
    assert model_key(reloaded.to(torch.bfloat16)) == key  # the fingerprint is taken at bf16 precision
    with torch.no_grad():
        b.model.layers[0].self_attn.q_proj.weight[0, 0] += 0.5
    assert model_key(b) != key
    assert model_key(tiny_model("llama", 3, 4, 2, seed=1)) != key
    ident = model_identity(a)
    assert ident["num_layers"] == 3 and ident["num_attention_heads"] == 4 and ident["num_key_value_heads"] == 2
    assert ident["head_dim"] == 16 and ident["hidden_size"] == 64 and len(ident["fingerprint"]) == 64
    json.dumps(ident)


def test_round_trip_in_home(isolated_home):
    model = tiny_model("qwen2", 2, 4, 2)
    tensors = {"scores": torch.rand(2, 4), "kept": torch.tensor([True, False])}
    path = save_artifact("demo", model, tensors, {"settings": {"n": 3}, "seconds": 1.5})
    assert path == isolated_home / "artifacts" / model_key(model) / "demo.safetensors"
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["format_version"] == 1 and meta["kind"] == "demo" and meta["model_key"] == model_key(model)
    assert meta["settings"] == {"n": 3} and meta["seconds"] == 1.5 and meta["kvtrim_version"]
    assert meta["model_identity"]["fingerprint"] and meta["created_utc"].endswith("Z")
    art = load_artifact("demo", model)
    assert art.source == "home" and art.kind == "demo"
    torch.testing.assert_close(art.tensors["scores"], tensors["scores"])
    assert art.tensors["kept"].tolist() == [True, False]
    text = describe_artifact(art)
    assert "demo artifact" in text and model_key(model) in text and "scores: 2x4" in text


def test_explicit_path_file_or_directory(tmp_path):
    model = tiny_model("llama")
    path = save_artifact("demo", model, {"x": torch.ones(2, 2)}, {}, directory=tmp_path / "root")
    for where in (path, path.with_suffix(".json"), path.parent, tmp_path / "root"):
        art = load_artifact("demo", model, where)
        assert art.source == "path" and art.path == path
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate demo"):
        load_artifact("demo", model, tmp_path / "nowhere")


def test_missing_artifact_names_the_command():
    model = tiny_model("llama")
    with pytest.raises(MissingArtifactError) as info:
        load_artifact("headkv", model)
    message = str(info.value)
    assert "kvtrim calibrate headkv --model" in message and model_key(model) in message


def test_identity_mismatch_rejected(tmp_path):
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    path = save_artifact("demo", model, {"x": torch.ones(1)}, {}, directory=tmp_path)
    with pytest.raises(ArtifactMismatchError, match="another model"):
        load_artifact("demo", other, path)
    bigger = tiny_model("llama", layers=3)
    with pytest.raises(ArtifactMismatchError, match="num_layers"):
        load_artifact("demo", bigger, path)


def test_unknown_format_version_and_wrong_kind_rejected(tmp_path):
    model = tiny_model("llama")
    path = save_artifact("demo", model, {"x": torch.ones(1)}, {}, directory=tmp_path)
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactMismatchError, match="format_version=99"):
        load_artifact("demo", model, path)
    meta["format_version"], meta["kind"] = 1, "other"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactMismatchError, match="not 'demo'"):
        load_artifact("demo", model, path)


def test_home_takes_precedence_over_package(isolated_home, monkeypatch, tmp_path):
    """The package's shipped directory is searched last."""
    import kvtrim.artifacts.store as artifacts

    model = tiny_model("llama")
    shipped_root = tmp_path / "pkg"
    save_artifact("demo", model, {"x": torch.zeros(1)}, {"where": "package"}, directory=shipped_root)

    from contextlib import contextmanager

    @contextmanager
    def fake_package_file(key, kind):
        candidate = shipped_root / key / f"{kind}.safetensors"
        yield candidate if candidate.is_file() else None

    monkeypatch.setattr(artifacts, "_package_file", fake_package_file)
    art = load_artifact("demo", model)
    assert art.source == "package" and art.meta["where"] == "package"
    save_artifact("demo", model, {"x": torch.ones(1)}, {"where": "home"})
    art = load_artifact("demo", model)
    assert art.source == "home" and art.meta["where"] == "home"
