"""The registry of named compression methods: the ``register`` decorator, :class:`MethodInfo` and look-up.

A method is a factory whose keyword arguments are its parameters; it returns the :class:`Pipeline` of parts it
composes (scorer → budget allocator → selector). The registry names the pipeline and records the arguments it
was built with (``pipeline.params``, every default filled in), so factories state each parameter once, in their
signature. What a method can do (:class:`Capabilities`) is read from the classes of its parts, not from its name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from ..compression.pipeline import Pipeline
from ..compression.schedule import TailFull, parse_schedule
from ..errors import InvalidParameterError

__all__ = [
    "Capabilities",
    "MethodInfo",
    "capabilities_of",
    "get_method",
    "method_info",
    "method_names",
    "methods",
    "parts",
    "register",
    "registered",
    "split_schedule",
]

UNNAMED = ""  # the name a factory's pipeline has until the registry names it

BUDGET_KINDS = {"none": "uniform", "layer": "per layer", "head": "per head"}


@dataclass(frozen=True)
class Capabilities:
    """What a method needs and where it runs, derived from its parts (:func:`capabilities_of`).

    Attributes:
        attention: its scores read attention weights of prompt queries (``uses_attention`` of the scorer)
        question_aware: the last prompt queries steer what is kept, so a question ending the prompt matters
            (``question_aware`` of the scorer or of the channel pruning)
        budgets: ``"uniform"``, ``"per layer"`` or ``"per head"`` (``varies_by`` of the budget allocator;
            per-head counts are stored ragged)
        artifacts: calibration artifact kinds it loads (``artifact_kind`` of any part; ``kvtrim calibrate KIND``)
        channels: it prunes key channels (ThinK) instead of / besides evicting tokens
        recursive: its default schedule compresses again while decoding (LagKV's frame)
        schedules: the decoding-time schedules ``name@schedule`` accepts (``tail`` needs ``lag_partitions`` on the
            selector; channel pruning accepts none)
        paged_engine: ``kvtrim serve`` runs it on paged storage (``paged_engine`` of the budget allocator)
        vllm: the vLLM plugin runs it (``runs_in_vllm`` on scorer, budget and selector, no channel pruning and no
            merging)
        merges: evicted values are folded into the kept entries (``Pipeline.merge``), which then hold merged values
        rerotates: the kept keys are rotated to contiguous positions after eviction (``Pipeline.rerotate``)
    """

    attention: bool
    question_aware: bool
    budgets: str
    artifacts: tuple[str, ...]
    channels: bool
    recursive: bool
    schedules: tuple[str, ...]
    paged_engine: bool
    vllm: bool
    merges: bool = False
    rerotates: bool = False

    def labels(self) -> list[str]:
        """Short labels, for listings and the README table."""
        out = ["attention" if self.attention else "attention-free"]
        if self.question_aware:
            out.append("question-aware")
        if self.budgets != "uniform":
            out.append(f"{self.budgets.replace(' ', '-')} budgets")
        if self.artifacts:
            out.append(f"calibrate: {', '.join(self.artifacts)}")
        if self.channels:
            out.append("key channels")
        if self.merges:
            out.append("merges evicted values")
        if self.rerotates:
            out.append("re-rotates kept keys")
        if self.recursive:
            out.append("recursive while decoding")
        if self.paged_engine:
            out.append("paged engine (`kvtrim serve`)")
        if self.vllm:
            out.append("vLLM")
        return out


def _declared(part, name: str):
    """A capability the part's class must declare (a missing one is a bug in the part, not a default)."""
    try:
        return getattr(part, name)
    except AttributeError:
        raise TypeError(f"{type(part).__name__} does not declare the capability {name!r}") from None


def capabilities_of(pipeline: Pipeline) -> Capabilities:
    """Read the capabilities its parts declare (class attributes or properties; see :class:`Capabilities`).

    Scorers must declare ``uses_attention`` and ``question_aware``, budget allocators ``varies_by``; the others
    default to absent: ``artifact_kind`` None, ``runs_in_vllm``/``paged_engine``/``lag_partitions`` False.
    """
    parts = pipeline.parts
    channels = pipeline.channels
    varies_by = _declared(pipeline.budget, "varies_by")
    if varies_by not in BUDGET_KINDS:
        raise TypeError(f"{type(pipeline.budget).__name__}.varies_by must be one of {sorted(BUDGET_KINDS)}")
    lag_partitions = getattr(pipeline.selector, "lag_partitions", False)
    kinds = {getattr(part, "artifact_kind", None) for part in parts}
    return Capabilities(
        attention=_declared(pipeline.scorer, "uses_attention"),
        question_aware=_declared(pipeline.scorer, "question_aware")
        or (channels is not None and channels.question_aware),
        budgets=BUDGET_KINDS[varies_by],
        artifacts=tuple(sorted(kind for kind in kinds if kind is not None)),
        channels=channels is not None,
        recursive=pipeline.schedule.continuous,
        schedules=()
        if channels is not None or pipeline.append is not None
        else ("every", "over") + (("tail",) if lag_partitions else ()),
        paged_engine=getattr(pipeline.budget, "paged_engine", False),
        vllm=channels is None
        and pipeline.merge is None  # the plugin evicts; it does not rewrite the kept values (or keys)
        and pipeline.rerotate is None
        and pipeline.append is None  # the plugin cannot add entries that are not tokens of the prompt
        and all(getattr(part, "runs_in_vllm", False) for part in parts),
        merges=pipeline.merge is not None,
        rerotates=pipeline.rerotate is not None,
    )


@dataclass(frozen=True)
class MethodInfo:
    """A registry entry.

    Attributes:
        name: registry name
        factory: builds the pipeline; its keyword arguments (with defaults) are the method's parameters
        summary: one line on what it keeps
        paper: citation(s) with arXiv ids
        preset: whose settings the defaults follow
        family: the module of :mod:`kvtrim.methods` that holds it (attention eviction, KV-Compress, …)
    """

    name: str
    factory: Callable[..., Pipeline]
    summary: str
    paper: str
    preset: str
    family: str

    def defaults(self) -> dict:
        """Parameter name → default, in signature order."""
        return {
            name: p.default
            for name, p in inspect.signature(self.factory).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    @cached_property
    def capabilities(self) -> Capabilities:
        """What the method's parts declare, read from the pipeline its defaults build."""
        return capabilities_of(self.factory())


_REGISTRY: dict[str, MethodInfo] = {}


def register(name: str, *, family: str, summary: str, paper: str, preset: str):
    """Decorator adding a pipeline factory to the registry.

    The factory returned builds the pipeline, names it ``name`` and records its bound arguments (defaults
    applied) as ``pipeline.params``.
    """

    def wrap(factory: Callable[..., Pipeline]) -> Callable[..., Pipeline]:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is registered twice")
        signature = inspect.signature(factory)

        @functools.wraps(factory)
        def build(*args, **kwargs) -> Pipeline:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            pipeline = factory(*bound.args, **bound.kwargs)
            pipeline.name = name
            pipeline.params = dict(bound.arguments)
            return pipeline

        _REGISTRY[name] = MethodInfo(name, build, summary, paper, preset, family)
        return build

    return wrap


def parts(scorer, budget, selector, *, kind: type[Pipeline] = Pipeline, **options) -> Pipeline:
    """The pipeline a factory returns: its parts and options (``schedule``, ``channels`` …); the registry names it
    and records its parameters."""
    return kind(UNNAMED, scorer, budget, selector, **options)


def method_names() -> list[str]:
    """Names of all registered methods."""
    return sorted(_REGISTRY)


def split_schedule(name: str) -> tuple[str, str | None]:
    """``"snapkv@every:64"`` → ``("snapkv", "every:64")``; a plain name has no schedule."""
    base, sep, schedule = name.partition("@")
    return base, (schedule if sep else None)


def registered() -> list[MethodInfo]:
    """Every entry, in registration order (grouped by family, as :mod:`kvtrim.methods` imports them)."""
    return list(_REGISTRY.values())


def method_info(name: str) -> MethodInfo:
    """The registry entry for ``name`` (a ``@schedule`` suffix is ignored; the error lists the valid names)."""
    base, _ = split_schedule(name)
    if base not in _REGISTRY:
        raise InvalidParameterError(f"method={name!r} is unknown; valid methods: {', '.join(method_names())}")
    return _REGISTRY[base]


def get_method(name: str, **params) -> Pipeline:
    """Build the pipeline of method ``name`` with optional parameter overrides.

    ``name@schedule`` runs the method with a decoding-time schedule (see :mod:`kvtrim.compression.schedule`), e.g.
    ``"snapkv@every:64"`` re-compresses every 64 new tokens and ``"snapkv@over:0"`` caps every head at its budget.
    """
    info = method_info(name)
    _, schedule = split_schedule(name)
    allowed = info.defaults()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise InvalidParameterError(
            f"method {name!r} has no parameter(s) {unknown}; its parameters are {sorted(allowed) or 'none'}"
        )
    pipeline = info.factory(**params)
    if schedule is not None:
        parsed = parse_schedule(schedule, sink=int(pipeline.params.get("sink", 0)))
        if isinstance(parsed, TailFull) and "tail" not in capabilities_of(pipeline).schedules:
            raise InvalidParameterError(
                f"schedule 'tail:LAG' needs a lag-partition method (lagkv, localkv, lag_knorm), not {info.name!r}; "
                "use 'every:N' or 'over:SLACK'"
            )
        pipeline.schedule = parsed
        pipeline.name = name
    return pipeline


def methods() -> dict[str, str]:
    """Registry listing: name → one-line summary with the paper."""
    return {name: f"{info.summary} [{info.paper}]" for name, info in sorted(_REGISTRY.items())}
