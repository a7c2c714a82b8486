"""KVzap's learned surrogate: its score is what ranks the entries, computed from the hidden states as tokens arrive."""

from __future__ import annotations

import pytest
import torch

from conftest import gate_tensors, install_kvzap_weights, kvzap_tensors, tiny_model
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError, MissingArtifactError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.integration.hidden_states import attention_modules
from kvtrim.methods import get_method
from kvtrim.methods.registry import parts
from kvtrim.scoring.observation import ObservationSpec, TokenScores
from kvtrim.scoring.surrogate import GateScorer, HiddenStateSurrogateScorer, surrogate_predict
from kvtrim.selection.topk import TopKSelector


def test_surrogate_predict_by_hand():
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])  # [1 batch, 3 tokens, 2 hidden]
    linear = {"linear_weight": torch.tensor([[[1.0, 0.0], [0.0, -1.0]]]), "linear_bias": torch.tensor([[0.5, 0.0]])}
    out = surrogate_predict(linear, "linear", 0, hidden)  # [1, 2 kv heads, 3 tokens]
    assert torch.allclose(out, torch.tensor([[[1.5, 0.5, 1.5], [0.0, -2.0, -1.0]]]))
    mlp = {
        "mlp_w1": torch.tensor([[[1.0, 0.0]]]),  # width 1: the first hidden channel
        "mlp_b1": torch.tensor([[0.0]]),
        "mlp_w2": torch.tensor([[[2.0]]]),  # one KV head
        "mlp_b2": torch.tensor([[1.0]]),
    }
    gelu = torch.nn.functional.gelu(torch.tensor([1.0, 0.0, 1.0]))
    assert torch.allclose(surrogate_predict(mlp, "mlp", 0, hidden)[0, 0], 2 * gelu + 1)


def _hidden_states(model, ids):
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault(module.layer_idx, kwargs["hidden_states"].detach().clone())

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in attention_modules(model)]
    with torch.inference_mode():
        model(ids)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kept_entries_are_the_surrogate_top_k(kind):
    model = tiny_model("llama", layers=2)
    tensors = kvzap_tensors(model, seed=3)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    hidden = _hidden_states(model, ids)
    scorer = HiddenStateSurrogateScorer(model_type=kind, tensors=tensors)
    pipeline = parts(scorer, UniformBudget(), TopKSelector())
    cache = KVTrimCache(2, pipeline, BudgetSpec(budget=10), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    for layer in cache.layers:
        expected = surrogate_predict(tensors, kind, layer.layer_idx, hidden[layer.layer_idx])[0]  # [kv, 40]
        top = expected.topk(10, dim=-1).indices.sort(-1).values
        kept = layer.store.positions[0].sort(-1).values
        assert torch.equal(kept, top), (kind, layer.layer_idx)


def test_token_scores_follow_decoding_under_a_schedule():
    """``kvzap@every:N``: each decoded token is scored as it arrives and compacted with its entry."""
    model = tiny_model("llama", layers=2)
    tensors = kvzap_tensors(model, seed=5)
    scorer = HiddenStateSurrogateScorer(model_type="linear", tensors=tensors)
    pipeline = parts(scorer, UniformBudget(), TopKSelector())
    pipeline.schedule = get_method("snapkv@every:4").schedule  # a continuous schedule
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = KVTrimCache(2, pipeline, BudgetSpec(budget=12))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        out = model.generate(
            input_ids=ids, max_new_tokens=9, do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None
        )
    full = out[:, :-1]  # the last generated token was never fed back
    hidden = _hidden_states(model, full)
    assert cache.compressions >= 2
    for layer in cache.layers:
        store = layer.store
        stat = store.stat(scorer.observation.token_scores[0].stat)[0]  # [kv, stored]
        expected = surrogate_predict(tensors, "linear", layer.layer_idx, hidden[layer.layer_idx])[0]
        pos = store.positions[0]
        # layer 0's input is the token's embedding whatever the cache holds; deeper layers of decoded tokens saw
        # the compressed cache, so only their prompt entries match a full re-run
        real = (pos >= 0) & ((pos < ids.shape[1]) | (layer.layer_idx == 0))
        assert bool((pos >= ids.shape[1]).any())  # decoded tokens were kept and scored
        assert torch.allclose(stat[real], expected.gather(-1, pos.clamp(min=0))[real], atol=1e-4)


def test_missing_artifact_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2, seed=7)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate kvzap"):
        get_method("kvzap").bind(model)


def test_artifact_weights_are_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2)
    install_kvzap_weights(model, seed=3)
    pipeline = get_method("kvzap", model_type="linear").bind(model)
    hidden = torch.randn(1, 5, model.config.hidden_size)
    got = pipeline.scorer.observation.token_scores[0](model, 1, hidden)
    assert torch.allclose(got, surrogate_predict(kvzap_tensors(model, seed=3), "linear", 1, hidden), atol=1e-6)


def test_bad_parameters_are_named():
    with pytest.raises(InvalidParameterError, match="model_type"):
        get_method("kvzap", model_type="cnn")
    with pytest.raises(InvalidParameterError, match="n_sink"):
        get_method("kvzap", n_sink=-1)
    with pytest.raises(InvalidParameterError, match="layerwise"):
        get_method("kvzap", layerwise="yes")


class _Named(TokenScores):
    def __init__(self, stat):
        self.stat = stat


def test_observation_spec_token_scores_cover_and_merge():
    a, b = ObservationSpec(token_scores=(_Named("x"),)), ObservationSpec(token_scores=(_Named("y"),))
    assert a.covers(ObservationSpec(token_scores=(_Named("x"),))) and not a.covers(b)
    assert not ObservationSpec().covers(a) and a.covers(ObservationSpec())
    assert a.merge(ObservationSpec(window=4)).slot_stats == ("x",)
    both = a.merge(b).merge(a)
    assert both.slot_stats == ("x", "y") and both.covers(a) and both.covers(b)


def test_two_surrogates_share_one_prefill(tmp_path, monkeypatch):
    """A Session prefills once for kvzap and fastkvzip: both token scores are recorded, each method ranks by its own."""
    import kvtrim
    from conftest import byte_tokenizer

    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2)
    install_kvzap_weights(model, seed=3)
    methods = ["kvzap", "fastkvzip"]
    session = kvtrim.Session(model, byte_tokenizer(), "some context " * 8, "a question?", methods=methods)
    for method in ("kvzap", "fastkvzip"):
        result = session.run(method, ratio=0.5, max_new_tokens=2)
        assert result.stats.kv_entries_after < result.stats.kv_entries_before


def test_dms_thresholds_the_surrogate_score(tmp_path, monkeypatch):
    """KVzap's paper rule: ``dms`` with ``scorer="kvzap"`` keeps the recent window plus every entry scoring >= τ."""
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2)
    install_kvzap_weights(model, seed=3)
    pipeline = get_method("dms", scorer="kvzap", threshold=0.5, recent=4)
    assert isinstance(pipeline.scorer, HiddenStateSurrogateScorer)
    ids = torch.randint(3, 200, (1, 32), generator=torch.Generator().manual_seed(4))
    hidden = _hidden_states(model, ids)
    cache = KVTrimCache(2, pipeline.bind(model), BudgetSpec(ratio=0.0), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    tensors = kvzap_tensors(model, seed=3)
    for layer in cache.layers:
        scores = surrogate_predict(tensors, "mlp", layer.layer_idx, hidden[layer.layer_idx])[0]  # [kv, 32]
        for head in range(scores.shape[0]):
            expected = sorted(set((scores[head] >= 0.5).nonzero().flatten().tolist()) | set(range(28, 32)))
            pos = layer.store.positions[0, head] if layer.store.layout == "dense" else layer.store.row(0, head)[2]
            assert sorted(int(p) for p in pos.tolist() if p >= 0) == expected


def test_gate_by_hand():
    """One KV head, one query per group, width 2, one sink key: σ(q·k/√2 + b − q·s/√2)."""
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [1, 2 tokens, hidden 2]
    tensors = {
        "gate_q_weight": torch.eye(2)[None],  # q = h
        "gate_q_bias": torch.zeros(1, 2),
        "gate_k_weight": torch.tensor([[[1.0, 0.0], [1.0, 0.0]]]),  # k = (h0, h0)
        "gate_q_norm": torch.ones(1, 2),
        "gate_k_norm": torch.ones(1, 2),
        "gate_bias": torch.tensor([[[0.5]]]),
        "gate_sink_keys": torch.tensor([[[[1.0, -1.0]]]]),
    }
    got = surrogate_predict(tensors, "gate", 0, hidden)[0, 0]  # [2 tokens]

    def rms(v):
        return v / torch.sqrt(v.square().mean() + 1e-6)

    expected = []
    for h in hidden[0]:
        q, k, s = rms(h), rms(torch.stack([h[0], h[0]])), torch.tensor([1.0, -1.0])
        logit = (q @ k) / 2**0.5 + 0.5
        expected.append(torch.sigmoid(logit - (q @ s) / 2**0.5))
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)
    assert bool(((got > 0) & (got < 1)).all())


def test_fastkvzip_pins_sinks_and_the_recent_window_and_ranks_by_the_gate():
    model = tiny_model("llama", layers=2)
    tensors = gate_tensors(model, seed=1)
    ids = torch.randint(3, 200, (1, 100), generator=torch.Generator().manual_seed(3))
    hidden = _hidden_states(model, ids)
    scorer = GateScorer(tensors=tensors, n_sink=4, window_ratio=0.05)
    pipeline = parts(scorer, UniformBudget(), TopKSelector())
    cache = KVTrimCache(2, pipeline, BudgetSpec(budget=20), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    pinned = set(range(4)) | set(range(95, 100))  # 4 sinks + ⌊0.05·100⌋ recent
    for layer in cache.layers:
        gate = surrogate_predict(tensors, "gate", layer.layer_idx, hidden[layer.layer_idx])[0]  # [kv, 100]
        for head in range(gate.shape[0]):
            rest = [p for p in gate[head].argsort(descending=True).tolist() if p not in pinned][: 20 - len(pinned)]
            kept = sorted(int(p) for p in layer.store.positions[0, head].tolist())
            assert kept == sorted(pinned | set(rest))


def test_fastkvzip_needs_its_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2, seed=8)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate fastkvzip"):
        get_method("fastkvzip").bind(model)
    with pytest.raises(InvalidParameterError, match="window_ratio"):
        get_method("fastkvzip", window_ratio=1.5)
