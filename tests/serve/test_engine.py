"""The serving engine on tiny random-weight models: exactness without eviction, pool accounting, preemption,
cancellation, streaming, rejection, error isolation and the effect of compression on the decode batch."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.serve import model_runner as runner_mod
from kvtrim.serve.engine import Engine, sample_token
from kvtrim.serve.requests import TextOutput as _TextOutput
from kvtrim.serve.types import SamplingParams

EOS = {2}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@torch.inference_mode()
def greedy_alone(model, ids: list[int], max_tokens: int, eos=EOS) -> list[int]:
    """The reference: the request alone, full DynamicCache, greedy."""
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    for _ in range(max_tokens):
        t = int(out.logits[0, -1].argmax())
        if t in eos:
            break
        tokens.append(t)
        if len(tokens) == max_tokens:
            break
        out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return tokens


def check_pool(engine: Engine) -> None:
    pool = engine.pool
    assert pool.num_used == engine.held_blocks()
    assert pool.num_used + pool.num_free == pool.num_blocks
    for r in engine.scheduler.running:  # the admission bound holds (a recompute prefill may exceed it)
        if not r.preemptions:
            assert r.blocks_held() + r.decode_blocks_needed() <= engine.blocks_bound(
                len(r.prompt_ids), r.params.max_tokens
            )


def run_checked(engine: Engine, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
        check_pool(engine)
    assert not engine.has_work()
    assert engine.pool.num_free == engine.pool.num_blocks


# ------------------------------------------------------------------------------------------- exactness
def _randomized(
    model, n_requests: int, seed: int, decode_buckets: bool = False, **engine_kwargs
) -> tuple[Engine, float]:
    rng = random.Random(seed)
    # 2 layers x 2 KV heads = 4 tables: 160 blocks hold ~40 tokens x 16 sequences; prompts and outputs
    # up to 40 + 24 tokens make the pool tight, so preemptions happen.
    engine = Engine(
        model, byte_tokenizer(), kv_blocks=160, block_size=8, compression_rate=1.0, decode_buckets=decode_buckets,
        **engine_kwargs,
    )  # fmt: skip
    specs = []
    for i in range(n_requests):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 40))]
        specs.append((f"r{i}", prompt, rng.randint(1, 24)))
    handles, cancel_at = {}, {}
    pending = list(specs)
    t0 = time.perf_counter()
    step = 0
    while pending or engine.has_work():
        for _ in range(min(len(pending), rng.choice([0, 0, 1, 2, 5]))):
            rid, prompt, max_tokens = pending.pop(0)
            handles[rid] = engine.submit(prompt, SamplingParams(max_tokens=max_tokens), request_id=rid)
            if rng.random() < 0.1:
                cancel_at[rid] = step + rng.randint(0, 6)
        for rid, when in list(cancel_at.items()):
            if when <= step:
                engine.cancel(rid)
                del cancel_at[rid]
        engine.step()
        check_pool(engine)
        step += 1
    elapsed = time.perf_counter() - t0
    assert engine.pool.num_free == engine.pool.num_blocks
    cancelled = 0
    for rid, prompt, max_tokens in specs:
        out = handles[rid].result(timeout=0)
        ref = greedy_alone(model, prompt, max_tokens)
        if out.finish_reason == "cancelled":
            cancelled += 1
            assert out.token_ids == ref[: len(out.token_ids)], rid
        else:
            assert out.token_ids == ref, rid
            assert out.finish_reason == ("length" if len(ref) == max_tokens else "stop"), rid
    stats = engine.stats
    assert stats.preemptions > 0 and cancelled > 0 and stats.max_decode_batch > 4
    assert stats.requests_finished == n_requests
    return engine, elapsed


def test_1000_randomized_requests_match_running_alone(model):
    """~20 s: 1,000 requests arriving over time, ~10% cancelled, a pool tight enough to preempt."""
    _randomized(model, 1000, seed=2)


def test_chat_and_text_prompts_match_alone(model, tok):
    engine = Engine(model, tok, kv_blocks=400, compression_rate=1.0)
    h1 = engine.submit("hello world", SamplingParams(max_tokens=12))
    h2 = engine.submit([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=12))
    h3 = engine.submit("hi", SamplingParams(max_tokens=12), chat=True)
    run_checked(engine)
    assert h1.result().token_ids == greedy_alone(model, tok("hello world")["input_ids"], 12)
    assert h2.result().token_ids == h3.result().token_ids
    assert h2.prompt_tokens == len(tok("user: hi\nassistant:")["input_ids"])


# ------------------------------------------------------------------------------------------- rejection
def test_rejects_requests_that_can_never_fit(model, tok):
    engine = Engine(model, tok, kv_blocks=40, block_size=16)  # 4 tables: 160 tokens per sequence at most
    with pytest.raises(InvalidParameterError, match="KV blocks"):
        engine.submit([5] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidParameterError, match="KV blocks"):
        engine.submit([5] * 200, SamplingParams(max_tokens=1))
    engine.submit([5] * 100, SamplingParams(max_tokens=60))  # exactly fits: 159 tokens fed at most
    with pytest.raises(InvalidParameterError, match="max_position_embeddings=2048"):
        Engine(model, tok, kv_blocks=10_000).submit([5] * 2000, SamplingParams(max_tokens=49))
    with pytest.raises(InvalidParameterError, match="token ids"):
        engine.submit([5, 100_000])
    with pytest.raises(InvalidParameterError, match="prompt"):
        engine.submit("")
    with pytest.raises(InvalidParameterError, match="role"):
        engine.submit([{"content": "x"}])
    engine.submit([5], request_id="dup")
    with pytest.raises(InvalidParameterError, match="dup"):
        engine.submit([6], request_id="dup")
    run_checked(engine)


def test_compression_lets_longer_requests_in(model, tok):
    plain = Engine(model, tok, kv_blocks=60, block_size=16)
    with pytest.raises(InvalidParameterError):
        plain.submit([5] * 200, SamplingParams(max_tokens=100, ignore_eos=True))
    squeezed = Engine(model, tok, kv_blocks=60, block_size=16, compression_rate=8, min_cache_tokens=32)
    h = squeezed.submit([5] * 200, SamplingParams(max_tokens=100, ignore_eos=True))
    run_checked(squeezed)
    assert len(h.result().token_ids) == 100 and squeezed.stats.blocks_evicted > 0


def test_engine_argument_errors(model, tok):
    with pytest.raises(InvalidParameterError, match="exactly one"):
        Engine(model, tok)
    with pytest.raises(InvalidParameterError, match="compression_rate"):
        Engine(model, tok, kv_blocks=10, compression_rate=0.5)
    with pytest.raises(InvalidParameterError, match="method"):
        Engine(model, tok, kv_blocks=10, method="snapkv")
    with pytest.raises(InvalidParameterError, match="kv_bytes"):
        Engine(model, tok, kv_memory_bytes=10)
    with pytest.raises(InvalidParameterError, match="max_batch"):
        Engine(model, tok, kv_blocks=10, max_batch=0)
    with pytest.raises(InvalidParameterError, match="compression_interval"):
        Engine(model, tok, kv_blocks=10, compression_interval=0)
    e = Engine(model, tok, kv_memory_bytes=2 * 16 * 16 * 4 * 100)  # 100 fp32 blocks of 16 x head_dim 16
    assert e.pool.num_blocks == 100


# ------------------------------------------------------------------------------------ error isolation
def test_failing_sampler_finishes_only_its_request(model, tok, monkeypatch):
    def flaky(logits, params, generator, greedy=None):
        if params.seed == 666:
            raise RuntimeError("sampler exploded")
        return sample_token(logits, params, generator, greedy)

    monkeypatch.setattr(runner_mod, "sample_token", flaky)
    engine = Engine(model, tok, kv_blocks=200)
    good = [engine.submit(random_text(20, seed=i), SamplingParams(max_tokens=10)) for i in range(3)]
    bad = engine.submit("boom", SamplingParams(max_tokens=10, seed=666))
    run_checked(engine)
    assert bad.result().finish_reason == "error" and "sampler exploded" in bad.result().error
    for i, h in enumerate(good):
        assert h.result().token_ids == greedy_alone(model, tok(random_text(20, seed=i))["input_ids"], 10)


def test_failing_stop_handling_and_prefill_finish_only_their_request(model, tok, monkeypatch):
    original_add, original_prefill = _TextOutput.add, Engine._prefill_chunks

    def add(self, token_id):
        if "explode" in self.stop:
            raise ValueError("stop handling exploded")
        return original_add(self, token_id)

    def prefill(self, chunks):
        if any(r.request_id == "bad-prefill" for r, _ in chunks):
            raise RuntimeError("prefill exploded")
        return original_prefill(self, chunks)

    monkeypatch.setattr(_TextOutput, "add", add)
    monkeypatch.setattr(Engine, "_prefill_chunks", prefill)
    engine = Engine(model, tok, kv_blocks=200)
    ok = engine.submit("abc", SamplingParams(max_tokens=8))
    bad1 = engine.submit("abc", SamplingParams(max_tokens=8, stop=("explode",)))
    # every chunk of a step shares one packed forward, so a failing forward fails that step's prefills: the bad
    # prefill comes one step later, when the others already decode
    engine.step()
    bad2 = engine.submit("abcdef", SamplingParams(max_tokens=8), request_id="bad-prefill")
    run_checked(engine)
    assert bad1.result().finish_reason == "error" and "stop handling" in bad1.result().error
    assert bad2.result().finish_reason == "error" and "prefill exploded" in bad2.result().error
    assert ok.result().token_ids == greedy_alone(model, tok("abc")["input_ids"], 8)


def test_failed_decode_forward_fails_its_batch_and_serving_goes_on(model, tok, monkeypatch):
    real, failed = runner_mod.PagedBatchCache, []

    def flaky(config, pool, sequences, **kw):
        if "accumulate_decode_metric" in kw and not failed:  # the first decode forward
            failed.append(len(sequences))
            raise RuntimeError("decode exploded")
        return real(config, pool, sequences, **kw)

    monkeypatch.setattr(runner_mod, "PagedBatchCache", flaky)
    engine = Engine(model, tok, kv_blocks=200)
    first = [engine.submit("abc", SamplingParams(max_tokens=8)), engine.submit("abd", SamplingParams(max_tokens=8))]
    run_checked(engine)
    assert failed == [2] and all(h.result().finish_reason == "error" for h in first)
    later = engine.submit("abc", SamplingParams(max_tokens=8))
    run_checked(engine)
    assert later.result().token_ids == greedy_alone(model, tok("abc")["input_ids"], 8)


# --------------------------------------------------------------------------------------- cancellation
def test_cancel_waiting_and_running(model, tok):
    engine = Engine(model, tok, kv_blocks=40, block_size=16)  # one 100-token prompt at a time
    a = engine.submit([7] * 100, SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    b = engine.submit([8] * 100, SamplingParams(max_tokens=50, ignore_eos=True), request_id="b")
    engine.step()
    engine.step()
    assert len(a.output.token_ids) >= 1 and not b.output.token_ids  # b waits for memory
    assert engine.cancel("b") and engine.cancel("a")
    assert engine.cancel("a")  # again before the step: still unfinished, and harmless
    engine.step()
    check_pool(engine)
    assert a.result(timeout=0).finish_reason == "cancelled" and b.result(timeout=0).finish_reason == "cancelled"
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.cancel("a") and not engine.cancel("nope")


# ------------------------------------------------------------------------------------------ streaming
def test_streaming_order_and_text(model, tok):
    engine = Engine(model, tok, kv_blocks=200)
    h = engine.submit("stream me", SamplingParams(max_tokens=20, ignore_eos=True))
    run_checked(engine)
    events = list(h.events(timeout=1))
    assert [e.finished for e in events] == [False] * 19 + [True]
    assert events[-1].finish_reason == "length"
    assert [e.token_id for e in events] == h.result().token_ids
    assert "".join(e.text for e in events) == h.result().text == tok.decode(h.result().token_ids)


def test_stop_string_cuts_text_and_is_never_streamed(model, tok):
    ids = tok("the prompt")["input_ids"]
    full = tok.decode(greedy_alone(model, ids, 30, eos=set()))
    stop = full[10:13]
    engine = Engine(model, tok, kv_blocks=200)
    h = engine.submit("the prompt", SamplingParams(max_tokens=30, stop=(stop, "never-there"), ignore_eos=True))
    run_checked(engine)
    out = h.result()
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    events = list(h.events(timeout=1))
    assert "".join(e.text for e in events) == out.text and events[-1].token_id is None


def test_background_thread_concurrent_submitters(model, tok):
    engine = Engine(model, tok, kv_blocks=120, block_size=8)
    engine.start()
    results, errors = {}, []

    def client(k: int) -> None:
        try:
            for j in range(5):
                text = random_text(10 + j, seed=100 * k + j)
                h = engine.submit(text, SamplingParams(max_tokens=6))
                streamed = [e.token_id for e in h.events(timeout=30) if e.token_id is not None]
                results[(k, j)] = (text, streamed, h.result(timeout=30).token_ids)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.stop()
    assert not errors and len(results) == 20
    for text, streamed, final in results.values():
        assert streamed == final == greedy_alone(model, tok(text)["input_ids"], 6)
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.running


def test_stop_cancels_pending(model, tok):
    engine = Engine(model, tok, kv_blocks=200)
    h = engine.submit("abc", SamplingParams(max_tokens=5))
    engine.stop()
    assert h.result(timeout=1).finish_reason == "cancelled"


# ------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_independent_of_batching(model, tok):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    alone = Engine(model, tok, kv_blocks=200)
    h = alone.submit("sample", params)
    run_checked(alone)
    busy = Engine(model, tok, kv_blocks=200)
    others = [busy.submit(random_text(15, seed=i), SamplingParams(max_tokens=12, temperature=1.0)) for i in range(4)]
    h2 = busy.submit("sample", params)
    run_checked(busy)
    assert h.result().token_ids == h2.result().token_ids
    assert len({tuple(o.result().token_ids) for o in others}) > 1
    greedy = Engine(model, tok, kv_blocks=200)
    g = greedy.submit("sample", SamplingParams(max_tokens=12, ignore_eos=True))
    run_checked(greedy)
    assert g.result().token_ids != h.result().token_ids


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    g = torch.Generator().manual_seed(0)
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(50)}
    assert picks == {0}
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.99), g) for _ in range(200)}
    assert picks == {0, 1}


# ----------------------------------------------------------------------------------------- compression
def _batch_under_tight_pool(model, tok, cr: float, method: str = "kvcompress", compress_once: bool = False):
    engine = Engine(
        model, tok, kv_blocks=96, block_size=16, compression_rate=cr, min_cache_tokens=16, protected_window=8,
        method=method, compress_once=compress_once,
    )  # fmt: skip
    handles = [
        engine.submit(random_text(120, seed=i), SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(12)
    ]
    run_checked(engine)
    assert all(len(h.result().token_ids) == 40 for h in handles)
    return engine.stats


def test_compression_frees_blocks_and_raises_decode_batch(model, tok):
    full = _batch_under_tight_pool(model, tok, 1.0)
    squeezed = _batch_under_tight_pool(model, tok, 8.0)
    assert full.compressions == 0 and full.blocks_evicted == 0
    assert squeezed.compressions > 0 and squeezed.blocks_evicted > 0
    assert squeezed.max_decode_batch >= 2 * full.max_decode_batch
    assert squeezed.decode_steps < full.decode_steps


@pytest.mark.parametrize(("method", "once"), [("kvc_w8", False), ("kvc_full", False), ("kvcompress", True)])
def test_methods_and_compress_once_run(model, tok, method, once):
    stats = _batch_under_tight_pool(model, tok, 4.0, method=method, compress_once=once)
    assert stats.blocks_evicted > 0


def test_compression_rate_one_never_evicts_and_big_budget_is_exact(model, tok):
    """A compressing engine whose budget covers every sequence evicts nothing and stays exact."""
    engine = Engine(model, tok, kv_blocks=400, compression_rate=2.0, min_cache_tokens=256)
    texts = [random_text(30 + i, seed=i) for i in range(4)]
    handles = [engine.submit(t, SamplingParams(max_tokens=15)) for t in texts]
    run_checked(engine)
    assert engine.stats.blocks_evicted == 0
    for t, h in zip(texts, handles, strict=True):
        assert h.result().token_ids == greedy_alone(model, tok(t)["input_ids"], 15)


# ------------------------------------------------------------------------------------------ text output
def _stream(tok, text: str, stop: tuple[str, ...]) -> tuple[list[str], bool, str]:
    out = _TextOutput(lambda ids: tok.decode(ids, skip_special_tokens=True), stop)
    pieces, stopped = [], False
    for t in tok(text)["input_ids"]:
        piece, stopped = out.add(t)
        pieces.append(piece)
        if stopped:
            break
    tail = "" if stopped else out.flush()
    return pieces, stopped, tail


def test_text_output_holds_incomplete_characters_and_stop_prefixes(tok):
    pieces, stopped, tail = _stream(tok, "aé b€c", ())
    assert not stopped and "".join(pieces) + tail == "aé b€c"
    assert all("\ufffd" not in p for p in pieces)
    pieces, stopped, _ = _stream(tok, "abxyz", ("xy", "q"))
    assert stopped and "".join(pieces) == "ab" and pieces[2] == ""  # "x" was held back, then cut
    pieces, stopped, tail = _stream(tok, "abxz", ("xy",))
    assert not stopped and "".join(pieces) + tail == "abxz" and pieces[2] == "" and pieces[3] == "xz"


# ------------------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_matches_running_alone_without_compression(model, tok):
    """Prompts longer than the chunk are fed over several steps, several prompts per forward; exact at cr 1."""
    engine = Engine(model, tok, kv_blocks=600, block_size=8, prefill_chunk=16, max_num_batched_tokens=40)
    texts = [random_text(50 + 7 * i, seed=i) for i in range(5)]
    handles = [engine.submit(t, SamplingParams(max_tokens=10)) for t in texts]
    run_checked(engine)
    s = engine.stats
    assert s.prefills == 5 and s.prefill_chunks == sum(-(-len(tok(t)["input_ids"]) // 16) for t in texts)
    for t, h in zip(texts, handles, strict=True):
        assert h.result().token_ids == greedy_alone(model, tok(t)["input_ids"], 10)


def test_long_prompt_delays_running_streams_by_one_chunk_per_step(model, tok):
    engine = Engine(model, tok, kv_blocks=2000, block_size=8, prefill_chunk=32, max_num_batched_tokens=64)
    short = engine.submit("hello", SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # short is prefilled and decoding
    long = engine.submit(random_text(300, seed=3), SamplingParams(max_tokens=2, ignore_eos=True))
    assert long.prompt_tokens == 300
    before = len(short.output.token_ids)
    fed = []
    while engine.stats.prefills < 2:
        chunks = engine.stats.prefill_chunks
        engine.step()
        fed.append(engine.stats.prefill_chunks - chunks)
    # every step decoded the short stream once and fed one chunk of the long prompt
    assert fed == [1] * 10 and len(short.output.token_ids) == before + 10
    run_checked(engine)
    assert short.result().token_ids == greedy_alone(model, tok("hello")["input_ids"], 30, eos=set())


def test_chunked_compressed_prefill_is_independent_of_the_batch(model, tok):
    """With compression between chunks, a request's output depends only on itself (chunk boundaries are fixed)."""

    def make() -> Engine:
        return Engine(
            model, tok, kv_blocks=400, block_size=8, compression_rate=4.0, min_cache_tokens=16, protected_window=8,
            prefill_chunk=32, max_num_batched_tokens=80,
        )  # fmt: skip

    target = random_text(150, seed=11)
    alone = make()
    h = alone.submit(target, SamplingParams(max_tokens=20, ignore_eos=True))
    run_checked(alone)
    busy = make()
    others = [busy.submit(random_text(60 + 13 * i, seed=i), SamplingParams(max_tokens=25)) for i in range(4)]
    h2 = busy.submit(target, SamplingParams(max_tokens=20, ignore_eos=True))
    run_checked(busy)
    assert h2.result().token_ids == h.result().token_ids
    assert all(o.result().finish_reason in ("length", "stop") for o in others)
    assert alone.stats.compressions >= 4  # compressed after chunks 1..4 and after the prefill
    assert busy.stats.peak_blocks_used < busy.pool.num_blocks


def test_admission_by_compressed_size_beats_the_uncompressed_prompt_bound(model, tok):
    """The pool holds 1.5 uncompressed prompts, yet compressed requests decode side by side (the old rule admitted
    a prompt only when its uncompressed blocks were free)."""
    tables = 2 * 2
    blocks = int(1.5 * tables * (200 + 30) / 8)
    engine = Engine(
        model, tok, kv_blocks=blocks, block_size=8, compression_rate=8.0, min_cache_tokens=16, protected_window=8,
        prefill_chunk=32,
    )  # fmt: skip
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    handles = [engine.submit(random_text(200, seed=i), params) for i in range(8)]
    run_checked(engine)
    assert all(len(h.result().token_ids) == 30 for h in handles)
    assert engine.stats.max_decode_batch >= 7  # one whole-prompt chunk (no compression between chunks) gives 6


# ------------------------------------------------------------------------------------------ tokenization
def test_submit_tokenizes_without_blocking_the_engine_thread(model, tok):
    """A slow tokenization in a caller's thread must not stall the streams the engine thread is decoding."""
    engine = Engine(model, tok, kv_blocks=400)
    engine.start()
    try:
        running = engine.submit("hello", SamplingParams(max_tokens=40, ignore_eos=True))
        next(running.events(timeout=10))
        entered, release = threading.Event(), threading.Event()
        real = engine._caller_tokenizer

        def slow_tokenizer():
            tok_copy = real()

            def encode(*args, **kwargs):
                entered.set()
                release.wait(10)
                return tok_copy(*args, **kwargs)

            return encode

        def submit_slow():
            engine._caller_tokenizer = slow_tokenizer  # only this thread's submit sees it before it is restored
            engine.submit("a slow prompt", SamplingParams(max_tokens=2))

        t = threading.Thread(target=submit_slow)
        t.start()
        assert entered.wait(10)
        engine._caller_tokenizer = real
        before = len(running.output.token_ids)
        deadline = time.monotonic() + 10
        while len(running.output.token_ids) < before + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(running.output.token_ids) >= before + 5  # decoding went on while the tokenizer was busy
        release.set()
        t.join(10)
        assert running.result(timeout=30).token_ids == greedy_alone(model, tok("hello")["input_ids"], 40, eos=set())
    finally:
        release.set()
        engine.stop()


def test_encode_is_thread_safe_and_matches_submit(model, tok):
    engine = Engine(model, tok, kv_blocks=100)
    texts = [random_text(200 + i, seed=i) for i in range(8)]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = engine.encode(texts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == tok(texts[i])["input_ids"] for i in range(8))
    assert engine.encode("hi", chat=True) == tok("user: hi\nassistant:")["input_ids"]
    with pytest.raises(InvalidParameterError, match="prompt"):
        engine.encode("")


def test_stats_expose_gauges_and_counters(model, tok):
    engine = Engine(model, tok, kv_blocks=300, block_size=8, prefill_chunk=16)
    engine.submit(random_text(40, seed=1), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.submit("hi", SamplingParams(max_tokens=5, ignore_eos=True))
    s = engine.stats()
    assert s.requests_waiting == 2 and s.requests_running == 0 and s.pool_blocks_free == 300
    engine.step()
    s = engine.stats()
    assert s.requests_running == 2 and s.requests_prefilling == 1 and s.requests_waiting == 0
    assert s.pool_blocks_used == engine.held_blocks() > 0 and s.pool_blocks_used + s.pool_blocks_free == 300
    run_checked(engine)
    s = engine.stats
    assert s.tokens_generated == 10 and s.requests_finished == 2 and s.prefill_chunks == 4
    assert set(s.as_dict()) >= {"preemptions", "compressions", "tokens_generated", "pool_blocks_used"}


# ------------------------------------------------------------------------------------------- static decode shapes
def test_batch_bucket_sizes():
    assert [runner_mod.batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 40]
    with pytest.raises(InvalidParameterError, match="at least one"):
        runner_mod.batch_bucket(0)


def test_bucketed_decode_matches_running_alone_with_static_shapes(model, monkeypatch):
    """Padded decode batches (1, 2, 4, 8, 16, ...) and power-of-two table widths: every output still equals the
    request alone, through preemptions and cancellations, and the pool leaks nothing."""
    real, shapes = runner_mod.PagedBatchCache, []

    class Recording(real):
        def _begin_forward(self, n, q):
            super()._begin_forward(n, q)
            if q == 1 and self.chunk_lengths is None:
                shapes.append((n, len(self.sequences), tuple(self._step["widths"])))

    monkeypatch.setattr(runner_mod, "PagedBatchCache", Recording)
    engine, _ = _randomized(model, 200, seed=3, decode_buckets=True)
    assert engine.pool.scratch_block == engine.pool.num_blocks  # the padding rows' block is outside the pool
    assert {n for n, _, _ in shapes} <= {1, 2, 4, 8, 16, 24, 32}
    assert any(n > k for n, k, _ in shapes)  # padding rows really ran
    assert all(w & (w - 1) == 0 for _, _, widths in shapes for w in widths)
    with pytest.raises(InvalidParameterError, match="decode_buckets"):
        Engine(model, byte_tokenizer(), kv_blocks=10, decode_buckets="yes")


@pytest.mark.parametrize("rate", [1.0, 4.0])
def test_batched_block_counts_equal_counting_each_request(model, tok, rate):
    """The scheduler's batched counts (one call over the block tables) give what asking each request gives, at
    every step of a run with chunked prefills, compression, preemptions, finishes and a cancellation."""
    from kvtrim.serve.scheduler import PerSequenceCounts

    engine = Engine(model, tok, kv_blocks=48, block_size=16, compression_rate=rate, min_cache_tokens=16,
                    protected_window=8, prefill_chunk=48)  # fmt: skip
    rng = random.Random(3)
    handles = [
        engine.submit(random_text(rng.randint(20, 100), seed=i), SamplingParams(max_tokens=rng.randint(20, 80),
                                                                                ignore_eos=True))
        for i in range(10)
    ]  # fmt: skip
    batched, each, checked = engine.scheduler.counts, PerSequenceCounts(), 0
    while engine.has_work():
        running = list(engine.scheduler.running)
        decoding = engine.scheduler.decoding()
        assert batched.decode_need(decoding) == each.decode_need(decoding)
        assert batched.committed(running) == each.committed(running)
        checked += bool(running)
        engine.step()
        if engine.stats.steps == 5:
            engine.cancel(handles[0].request_id)
    assert checked > 10 and engine.pool.num_free == engine.pool.num_blocks
    if rate > 1:
        assert engine.stats.compressions > 0
    assert engine.stats.preemptions > 0 or rate > 1
