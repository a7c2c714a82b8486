"""The device side of the serving engine: run one scheduled batch of paged sequences on the model.

The engine (:mod:`kvtrim.serve.engine`) decides what a step runs: which requests decode, which prefill chunks are
fed, which sequences are compressed and to what budget; it owns every request's lifecycle. The runner does the
device work of that decision and nothing else, as vLLM's ``GPUModelRunner`` does under its ``EngineCore``:

- it owns the KV memory (the :class:`~kvtrim.cache.block_pool.BlockPool`), the decode attention kernel (resolved
  once, before anything changes), the static decode buffers and the CUDA graphs (:mod:`kvtrim.serve.decode_graphs`);
- :meth:`ModelRunner.prefill` feeds packed prefill chunks of any lengths in one forward (and adds their KV-Compress
  metric), :meth:`ModelRunner.decode` runs one batched decode step (graph replay, static step or eager bucketed
  forward), :meth:`ModelRunner.compress` evicts a batch of sequences to their budgets, :meth:`ModelRunner.sample`
  reads the step's tokens.

It sees sequences only as :class:`~kvtrim.cache.paged.PagedSequence` (blocks, lengths, tokens seen): it never
creates, finishes, preempts or releases a request, and it keeps no per-request state between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache.paged import BlockPool, PagedBatchCache, PagedSequence
from ..cache.paged_kernels import choose_decode_kernel
from ..cache.quantized_block_pool import QuantizedBlockPool, pool_kv_quant
from ..cache.static_decode import batch_bucket
from ..errors import InvalidParameterError
from ..integration.attention import enable
from ..methods.presets import KVCompressPreset
from ..selection.block_eviction import compress_sequences, prefill_metric
from .decode_graphs import DecodeGraphRunner
from .scheduler import BlockGeometry
from .types import SamplingParams


@dataclass(frozen=True)
class PrefillChunk:
    """The next tokens of one sequence's (re)prefill: ``tokens`` continue ``sequence`` from its ``seen``."""

    sequence: PagedSequence
    tokens: list[int]


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, greedy: int | None = None
) -> int:
    """One token from ``logits`` ``[vocab]``: argmax at temperature 0, else temperature + nucleus (top-p).

    ``greedy``: the argmax, when the caller computed it for a whole batch at once (one host read per step)."""
    if params.temperature == 0.0:
        return int(logits.argmax()) if greedy is None else greedy
    # Per-request generators live on the CPU (seeds reproduce across devices): sample where the generator is.
    probs = torch.softmax(logits.float().to(generator.device) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # always keeps the most likely token
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class ModelRunner:
    """Runs scheduled batches of paged sequences through ``model`` over one block pool.

    Args:
        model: a supported transformers causal LM; kvtrim attention is installed on it
            (:class:`~kvtrim.errors.UnsupportedModelError` otherwise)
        kv_memory_bytes, kv_blocks: the pool's key+value bytes, or its blocks (exactly one)
        block_size: tokens per block
        eviction: the KV-Compress preset whose metric prefills record and :meth:`compress` ranks by (its
            ``protected_window`` is the one applied); None: no compression, no metric
        continual_metric: decode steps add their squared attention to the metric (KV-Compress's continual
            compression; needs ``eviction``)
        decode_buckets, decode_kernel, cuda_graphs, static_decode, cuda_graph_max_batch: the decode step, as
            :class:`~kvtrim.serve.engine.Engine` documents them
        kv_quant: ``None`` (entries in the model's dtype), ``"int8"`` or ``"int4"``: the pool holds packed entries
            with their scales (:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`) and
            ``kv_memory_bytes`` counts the packed bytes

    Attributes:
        model, pool, geometry: the model, the block pool (KV memory) and its block arithmetic
        decode_kernel: the name of the decode attention that runs (``"gather"`` or the kernel's name)
        decode_kernel_refused: each block-table kernel looked at and not chosen -> why
        graphs: the static-step runner (``cuda_graphs`` or ``static_decode``), else None
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kv_memory_bytes: int | None = None,
        kv_blocks: int | None = None,
        block_size: int = 16,
        eviction: KVCompressPreset | None = None,
        continual_metric: bool = False,
        decode_buckets: bool = False,
        decode_kernel: str = "gather",
        cuda_graphs: bool = False,
        static_decode: bool = False,
        cuda_graph_max_batch: int = 64,
        kv_quant: str | None = None,
    ):
        check_pool_size(kv_memory_bytes, kv_blocks)
        quant = pool_kv_quant(kv_quant)
        if not isinstance(decode_buckets, bool):
            raise InvalidParameterError(f"decode_buckets must be True or False, got {decode_buckets!r}")
        if continual_metric and eviction is None:
            raise InvalidParameterError("continual_metric=True needs an eviction preset (the metric it adds to)")
        device = next(model.parameters()).device
        _check_graph_args(decode_buckets, cuda_graphs, static_decode, cuda_graph_max_batch, device)
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        # The decode kernel is chosen before anything changes.
        choice = choose_decode_kernel(
            decode_kernel, device=device, dtype=dtype, block_size=block_size, head_dim=head_dim,
            kv_quant=quant,
        )  # fmt: skip
        kernel = choice.kernel
        # Each block-table kernel looked at and not chosen -> why (engine stats report it).
        self.decode_kernel_refused: dict[str, str] = dict(choice.refused)
        # The name of the decode attention that runs; the caches get the resolved kernel (no per-forward lookup).
        self.decode_kernel = "gather" if kernel is None else kernel.name
        self._attention_kernel = "gather" if kernel is None else kernel
        enable(model)  # raises UnsupportedModelError for unsupported architectures
        self.model = model
        self.decode_buckets = decode_buckets
        self.kv_quant = None if quant is None else quant.name
        if quant is not None:
            quant.check_head_dim(head_dim)
            if kv_blocks is not None:
                self.pool = QuantizedBlockPool(kv_blocks, block_size, head_dim, dtype, quant, device, decode_buckets)
            else:
                self.pool = QuantizedBlockPool.for_bytes(
                    kv_memory_bytes, block_size, head_dim, dtype, quant, device, decode_buckets
                )
        elif kv_blocks is not None:
            self.pool = BlockPool(kv_blocks, block_size, head_dim, dtype, device, scratch=decode_buckets)
        else:
            self.pool = BlockPool.for_bytes(kv_memory_bytes, block_size, head_dim, dtype, device, decode_buckets)
        self.geometry = BlockGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, block_size)
        self.eviction, self.continual_metric = eviction, continual_metric
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs or static_decode:
            self.graphs = DecodeGraphRunner(
                model, self.pool, accumulate_decode_metric=continual_metric,
                buffer=0 if eviction is None else eviction.buffer, max_batch=cuda_graph_max_batch,
                capture=cuda_graphs, decode_kernel=self._attention_kernel,
            )  # fmt: skip

    # ------------------------------------------------------------------------------------ sequences
    @torch.inference_mode()
    def new_sequence(self) -> PagedSequence:
        """An empty sequence of this pool (its blocks are the caller's to release)."""
        return PagedSequence(self.pool, self.geometry.layers, self.geometry.kv_heads)

    # ------------------------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Feed every chunk in ONE forward, packed back to back in one row whatever their lengths (varlen
        prefill); each chunk continues its sequence from its ``seen``. With eviction, each chunk's metric (its
        observation window's squared attention) is added to ``pool.metric``. Returns ``[len(chunks), vocab]``:
        the logits of each chunk's last token. Raises :class:`~kvtrim.cache.block_pool.OutOfBlocks` (nothing
        changed) when the chunks' blocks do not fit."""
        if not chunks:
            raise InvalidParameterError("prefill needs at least one chunk")
        lengths = [len(c.tokens) for c in chunks]
        tokens = [t for c in chunks for t in c.tokens]
        positions = [p for c in chunks for p in range(c.sequence.seen, c.sequence.seen + len(c.tokens))]
        window = 0
        if self.eviction is not None:
            longest = max(lengths)
            window = longest if self.eviction.window is None else min(self.eviction.window, longest)
        cache = PagedBatchCache(
            self.model.config, self.pool, [c.sequence for c in chunks], observe_window=window, chunk_lengths=lengths
        )
        device = self.pool.device
        ids = torch.tensor([tokens], device=device)
        pos = torch.tensor([positions], device=device)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=last)
        if self.eviction is not None:
            prefill_metric(cache, kernel=self.eviction.kernel, buffer=self.eviction.buffer)
        return out.logits[0]

    @torch.inference_mode()
    def decode(self, sequences: Sequence[PagedSequence], tokens: Sequence[int]) -> torch.Tensor:
        """One batched decode step: each sequence feeds its token at position ``seen``. Batches the static step
        handles replay a CUDA graph (or run the static step eagerly); others run the eager forward, padded to a
        batch bucket with ``decode_buckets``. Returns ``[n, vocab]`` logits, valid until the next step (they may be
        a view of a static buffer). Raises :class:`~kvtrim.cache.block_pool.OutOfBlocks` (nothing changed) when
        the new tokens' blocks do not fit."""
        if len(sequences) != len(tokens) or not sequences:
            raise InvalidParameterError(
                f"decode needs one token per sequence and at least one sequence, got {len(sequences)} sequences "
                f"and {len(tokens)} tokens"
            )
        sequences, tokens = list(sequences), list(tokens)
        if self.graphs is not None and self.graphs.handles(len(sequences)):
            # host preparation into static buffers, then a graph replay (or the same forward, eagerly)
            return self.graphs.run(sequences, tokens)
        n = len(sequences)
        pad = batch_bucket(n) - n if self.decode_buckets else 0
        input_ids = torch.tensor([[t] for t in tokens] + [[0]] * pad, device=self.pool.device)
        positions = torch.tensor([[s.seen] for s in sequences] + [[0]] * pad, device=self.pool.device)
        cache = PagedBatchCache(
            self.model.config,
            self.pool,
            sequences,
            accumulate_decode_metric=self.continual_metric,
            buffer=0 if self.eviction is None else self.eviction.buffer,
            bucketed=self.decode_buckets,
            decode_kernel=self._attention_kernel,
        )
        # the step's host preparation before the forward, so the forward itself never waits for the host
        cache.begin_forward(n + pad, 1, positions_checked=True)
        out = self.model(
            input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:n, -1]

    @torch.inference_mode()
    def compress(self, sequences: Sequence[PagedSequence], budgets: Sequence[int]) -> list[int]:
        """Evict every sequence down to its per-head average budget ``budgets[i]`` (tokens) in one batched
        eviction (one ranking, one MoveCache; :func:`~kvtrim.selection.block_eviction.compress_sequences`), the
        newest ``eviction.protected_window`` tokens of every head kept. Returns the blocks freed per sequence."""
        if self.eviction is None:
            raise InvalidParameterError("compress needs a runner built with an eviction preset")
        return compress_sequences(
            list(sequences), max_cache_tokens=list(budgets), protected_window=self.eviction.protected_window
        )

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        rows: Sequence[int] | None = None,
    ) -> list[int | Exception]:
        """The next token of each row ``rows[i]`` of ``logits`` ``[n, vocab]`` (default: every row) under
        ``params[i]`` with ``generators[i]``. The argmax of the whole batch is read in one host read (the step's
        token read). A row whose sampling raises gets the exception in its place: its request fails alone."""
        rows = range(len(params)) if rows is None else rows
        if not len(rows) == len(params) == len(generators):
            raise InvalidParameterError(
                f"sample needs one params and one generator per row, got {len(rows)} rows, {len(params)} params "
                f"and {len(generators)} generators"
            )
        greedy = logits.argmax(-1).tolist()
        tokens: list[int | Exception] = []
        for row, p, g in zip(rows, params, generators, strict=True):
            try:
                tokens.append(sample_token(logits[row], p, g, greedy[row]))
            except Exception as exc:  # handed back: the engine fails that request alone
                tokens.append(exc)
        return tokens

    # ------------------------------------------------------------------------------------ device
    def synchronize(self) -> None:
        """Wait for the accelerator's queued work (so a phase's wall time is its own). Nothing to wait for on a
        CPU."""
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

    def graph_counts(self) -> tuple[int, int, int]:
        """``(graphs captured, steps replayed from a graph, static steps run eagerly)``; zeros without the static
        step."""
        g = self.graphs
        return (0, 0, 0) if g is None else (g.captures, g.replays, g.eager_steps)


def check_pool_size(kv_memory_bytes: int | None, kv_blocks: int | None) -> None:
    """Exactly one of ``kv_memory_bytes`` and ``kv_blocks``; ``kv_blocks`` a positive integer."""
    if (kv_memory_bytes is None) == (kv_blocks is None):
        raise InvalidParameterError("give exactly one of kv_memory_bytes and kv_blocks")
    if kv_blocks is not None and (isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks <= 0):
        raise InvalidParameterError(f"kv_blocks must be a positive integer, got {kv_blocks!r}")


def _check_graph_args(decode_buckets, cuda_graphs, static_decode, max_batch, device) -> None:
    for name, value in (("cuda_graphs", cuda_graphs), ("static_decode", static_decode)):
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{name} must be True or False, got {value!r}")
        if value and not decode_buckets:
            raise InvalidParameterError(f"{name}=True needs decode_buckets=True (a graph replays static shapes)")
    if cuda_graphs and torch.device(device).type != "cuda":
        raise InvalidParameterError(
            f"cuda_graphs=True needs the model on a CUDA device, it is on {device}; static_decode=True runs the "
            "same static decode step eagerly on any device"
        )
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidParameterError(f"cuda_graph_max_batch must be an integer >= 1, got {max_batch!r}")
