"""ThinK (key-channel pruning) and DuoAttention (retrieval / streaming heads) as kvtrim methods."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import kvtrim
from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.artifacts.store import load_artifact, model_key
from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.duo_heads import DuoHeadBudget, load_duo_gates, streaming_head_order
from kvtrim.cache.channel_pruned import ChannelPrunedStore
from kvtrim.calibration.cli import calibrate_app
from kvtrim.calibration.duo import DuoCalibration, calibrate_duo, streaming_deviation
from kvtrim.compression.pipeline import Pipeline
from kvtrim.scoring.position import RecencyScorer
from kvtrim.selection.topk import TopKSelector

CTX = random_text(300, seed=4)
QUESTIONS = ["What comes next?", "Repeat the start."]
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def duo_artifact(tmp_path_factory):
    """A duo artifact for the tiny Llama, made by the real calibration procedure on short passkey prompts."""
    root = tmp_path_factory.mktemp("duo-arts")
    model = tiny_model("llama")
    path = calibrate_duo(model, byte_tokenizer(), DuoCalibration(samples=2, length=400, sink=4, recent=16), root)
    return path


def _answers(model, tokenizer, method, question_aware, **kw):
    return kvtrim.generate(
        model, tokenizer, CTX, QUESTIONS, method=method, question_aware=question_aware, max_new_tokens=6, **kw
    )


# ------------------------------------------------------------------------------------------------ ThinK
@pytest.mark.parametrize("question_aware", [False, True])
def test_think_with_no_channel_pruned_equals_its_token_method(llama, tokenizer, question_aware):
    snap = _answers(llama, tokenizer, "snapkv", question_aware, ratio=0.5)
    think = _answers(llama, tokenizer, "think_snapkv", question_aware, ratio=0.5, method_params={"channel_ratio": 0.0})
    assert think.answers == snap.answers
    assert think.stats.kv_entries_after == snap.stats.kv_entries_after
    assert think.stats.kv_bytes_after == snap.stats.kv_bytes_after
    assert think.stats.compression_metadata["key_channels_kept"] == 16


@pytest.mark.parametrize("question_aware", [False, True])
def test_think_alone_at_ratio_zero_is_the_full_model(llama, tokenizer, question_aware):
    full = _answers(llama, tokenizer, "full", question_aware)
    assert _answers(llama, tokenizer, "think", question_aware, ratio=0.0).answers == full.answers


@pytest.mark.parametrize("question_aware", [False, True])
def test_think_bytes_equal_the_kept_channels(llama, tokenizer, question_aware):
    res = _answers(llama, tokenizer, "think", question_aware, ratio=0.5)
    st = res.stats
    d, dk, elem = 16, 8, 4  # head_dim 16, fp32
    assert st.compression_metadata["key_channels_kept"] == dk
    assert st.kv_entries_after == st.kv_entries_before  # no token evicted
    assert st.kv_bytes_after == st.kv_entries_after * (dk + d) * elem
    assert st.kv_bytes_before == st.kv_entries_before * 2 * d * elem
    snap = _answers(llama, tokenizer, "think_snapkv", question_aware, ratio=0.5)
    assert snap.stats.kv_bytes_after == snap.stats.kv_entries_after * (dk + d) * elem
    assert all(isinstance(a, str) for a in res.answers)


def test_think_cache_stores_thinner_keys_and_decodes(llama):
    ids = torch.randint(5, 250, (2, 120))
    with torch.no_grad():
        cache = kvtrim.make_cache(llama, "think", ratio=0.25)
        out = llama.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 125)
    for layer in cache.layers:
        assert isinstance(layer.store, ChannelPrunedStore)
        assert layer.store.keys.shape == (2, 2, 124, 12) and layer.store.values.shape[-1] == 16
        assert layer.store.channels.shape == (2, 2, 12)
    with pytest.raises(kvtrim.InvalidParameterError, match="channel-pruned"):
        cache.compress()


def test_think_rejects_a_budget_a_schedule_and_bad_channel_ratios(llama, tokenizer):
    with pytest.raises(kvtrim.InvalidParameterError, match="fraction of key channels"):
        kvtrim.generate(llama, tokenizer, CTX, "q?", method="think", budget=64)
    with pytest.raises(kvtrim.InvalidParameterError, match="once after prefill"):
        kvtrim.generate(llama, tokenizer, CTX, "q?", method="think@every:16", ratio=0.5)
    for bad in (1.0, -0.1, "half"):
        with pytest.raises(kvtrim.InvalidParameterError, match="channel_ratio"):
            kvtrim.get_method("think_snapkv", channel_ratio=bad)
    # a token budget at or above the context keeps everything, channels included (BudgetSpec's rule)
    res = kvtrim.generate(llama, tokenizer, CTX, "q?", method="think_snapkv", budget=10_000, max_new_tokens=3)
    assert "key_channels_kept" not in res.stats.compression_metadata
    assert res.stats.kv_bytes_after == res.stats.kv_bytes_before


# ------------------------------------------------------------------------------------------------ DuoAttention
def _request(context: int, keep: int, layers=2, kv_heads=2) -> BudgetRequest:
    return BudgetRequest(
        keep=torch.tensor([keep]), context_lengths=torch.tensor([context]), num_layers=layers, kv_heads=kv_heads
    )


def test_duo_budgets_follow_the_ratio_and_the_gates():
    gates = torch.tensor([[0.9, 0.1], [0.5, 0.2]])  # streaming order: (0,1), (1,1), (1,0), (0,0)
    assert streaming_head_order(gates).tolist() == [3, 0, 2, 1]
    budget = DuoHeadBudget(sink=4, recent=16, gates=gates)
    # T=100, B=60, W=20: n_s = ceil(4·40/80) = 2 streaming heads
    assert budget.allocate(_request(100, 60), []).tolist() == [[[100, 20], [100, 20]]]
    # B=30: n_s = ceil(4·70/80) = 4 → every head streams, W=20 ≤ B
    assert budget.allocate(_request(100, 30), []).tolist() == [[[20, 20], [20, 20]]]
    # B=10 < W: every head streams with B tokens
    assert budget.allocate(_request(100, 10), []).tolist() == [[[10, 10], [10, 10]]]
    # B=T: nothing streams
    assert budget.allocate(_request(100, 100), []).tolist() == [[[100, 100], [100, 100]]]
    for keep in range(1, 101):  # never above the requested total
        assert int(budget.allocate(_request(100, keep), []).sum()) <= 4 * keep
    with pytest.raises(kvtrim.InvalidParameterError, match="layers"):
        budget.allocate(_request(100, 50, layers=3), [])
    with pytest.raises(kvtrim.InvalidParameterError, match="sink"):
        DuoHeadBudget(sink=-1)


def test_duo_streaming_heads_keep_sinks_and_recent_tokens(llama):
    gates = torch.tensor([[0.9, 0.1], [0.5, 0.2]])
    pipe = Pipeline("duo", RecencyScorer(), DuoHeadBudget(sink=4, recent=16, gates=gates), TopKSelector(sink=4))
    spec = kvtrim.BudgetSpec(ratio=0.5)
    ids = torch.randint(5, 250, (1, 100))
    cache = kvtrim.KVTrimCache(2, pipe.bind(llama), spec, auto_compress=False)
    with kvtrim.integration.attention.kvtrim_attention_enabled(llama), torch.no_grad():
        llama(ids, past_key_values=cache, use_cache=True)
    cache.compress()
    store = cache.layers[0].store
    assert store.layout == "ragged"
    # B=50, T=100, W=20: n_s = ceil(4·50/80) = 3 streaming heads, all but the highest gate (layer 0, head 0)
    assert cache.entries_per_layer_head().tolist() == [[[100, 20], [20, 20]]]
    _, _, positions = store.row(0, 1)
    assert positions.tolist() == [0, 1, 2, 3, *range(84, 100)]
    assert store.row(0, 0)[2].tolist() == list(range(100))
    assert cache.kv_nbytes() == cache.stats().entries * 2 * 16 * 4  # ragged: exactly the kept entries


def test_duo_artifact_round_trip_and_method(duo_artifact, tokenizer):
    model = tiny_model("llama")
    assert duo_artifact.name == "duo.safetensors" and duo_artifact.parent.name == model_key(model)
    art = load_artifact("duo", model, duo_artifact)
    assert art.meta["settings"]["sink"] == 4 and art.meta["summary"]["prompts"] == 2
    gates, source = load_duo_gates(model, duo_artifact)
    assert gates.shape == (2, 2) and float(gates.max()) == 1.0 and float(gates.min()) >= 0.0
    torch.testing.assert_close(art.tensors["deviation"], art.tensors["per_sample_deviation"].mean(0))
    assert source["artifact"] == str(duo_artifact)
    params = {"artifact": str(duo_artifact)}
    for question_aware in (False, True):
        full = _answers(model, tokenizer, "full", question_aware)
        same = _answers(model, tokenizer, "duo_attention", question_aware, budget=10_000, method_params=params)
        assert same.answers == full.answers  # nothing evicted: identical tokens
        res = _answers(model, tokenizer, "duo_attention", question_aware, ratio=0.5, method_params=params)
        assert res.stats.kv_entries_after <= res.stats.kv_entries_before // 2 + 1
        assert res.stats.kv_bytes_after == res.stats.kv_entries_after * 2 * 16 * 4


def test_duo_without_artifact_names_the_calibration_command(tokenizer):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(kvtrim.MissingArtifactError, match="kvtrim calibrate duo"):
        kvtrim.generate(model, tokenizer, CTX, "q?", method="duo_attention", ratio=0.5)
    assert model.config._attn_implementation == before


def test_streaming_deviation_is_zero_when_the_window_covers_everything():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8)
    w = torch.randn(32, 32, generator=g)
    out, dev = streaming_deviation(q, k, v, w, 0.3, sink=0, recent=10, last=4)
    assert out.shape == (1, 10, 4, 8) and dev.shape == (1, 2)
    torch.testing.assert_close(dev, torch.zeros(1, 2))
    _, dev = streaming_deviation(q, k, v, w, 0.3, sink=1, recent=2, last=4)
    assert bool((dev > 0).all())


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-duo")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_calibrate_duo_and_show(saved_model, tmp_path):
    out_dir = tmp_path / "arts"
    args = ["duo", "--model", str(saved_model), "--samples", "1", "--length", "300", "--out", str(out_dir)]
    result = runner.invoke(calibrate_app, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "duo artifact:" in result.output and "gates: (2, 2)" in result.output
    shown = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", "duo", "--path", str(out_dir)])
    assert shown.exit_code == 0, shown.output
    assert "duo artifact" in shown.output and "gates: 2x2" in shown.output
    missing = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", "duo"])
    assert missing.exit_code == 2 and "kvtrim calibrate duo --model" in missing.output
    bad = runner.invoke(calibrate_app, ["duo", "--model", str(saved_model), "--samples", "0"])
    assert bad.exit_code == 2 and "samples" in bad.output


# ------------------------------------------------------------------------------------------------ devices
@pytest.mark.parametrize("method", ["think", "think_snapkv", "duo_attention"])
def test_no_tensor_on_the_default_device(method, duo_artifact):
    """As shared/tools/device_clean.py: compress and decode while torch's default device is 'meta'."""
    model = tiny_model("llama")
    params = {"artifact": str(duo_artifact)} if method == "duo_attention" else {}
    ids = torch.randint(5, 250, (1, 200))
    with torch.no_grad():
        cache = kvtrim.make_cache(model, method, ratio=0.5, **params)  # duo: 3 of 4 heads stream → ragged
        out = model(ids, past_key_values=cache, use_cache=True)
        torch.set_default_device("meta")
        try:
            cache.compress()
            nxt = out.logits[:, -1:].argmax(-1)
            model(nxt, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[200]], device="cpu"))
        finally:
            torch.set_default_device(None)
    assert cache.stats().kv_bytes < cache.last_report.entries_before * 2 * 16 * 4
    if method == "duo_attention":
        assert cache.layers[0].store.layout == "ragged"


@pytest.mark.slow
def test_shipped_duo_artifact_loads_for_embedded_model(smollm2, monkeypatch, tmp_path):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))  # only the artifact shipped in the package can be found
    model, _ = smollm2
    art = load_artifact("duo", model)
    assert art.source == "package" and art.tensors["gates"].shape == (30, 3)
    assert art.meta["settings"]["sink"] == 16 and art.meta["settings"]["recent"] == 48
    assert art.meta["summary"]["prompts"] == 8
    budget = DuoHeadBudget()
    budget.bind(model)
    request = BudgetRequest(keep=torch.tensor([256]), context_lengths=torch.tensor([1024]), num_layers=30, kv_heads=3)
    assert int((budget.allocate(request, []) < 1024).sum()) == 72  # ratio 0.75: 72 of 90 heads stream
