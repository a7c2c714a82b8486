"""Q-Filters: a key's projection on the principal direction of the layer's queries (Godey et al., 2025).

Q-Filters (Godey et al., "Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value Cache Compression",
arXiv 2503.02812) observe that the queries of a head share a dominant direction ``u`` (the first right singular
vector of the query matrix, oriented so that ``E[⟨q, u⟩] > 0``), and that then ``E_q[⟨q, k⟩] ≈ κ ⟨k, u⟩`` with
``κ > 0``: the keys with the largest projection on ``u`` receive the most attention on average, whatever the
future query. The filters are computed once per model offline (``kvtrim calibrate qfilter``); at compression
time a key's score is one dot product, with no attention weights.

kvpress stores the opposite direction and negates the dot product (``−⟨k, f⟩`` with ``f = −u``): the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.qfilter import QFILTER_KIND, load_qfilters
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec

__all__ = ["QueryFilterScorer"]


@dataclass
class QueryFilterScorer(Scorer):
    """Score ``⟨k, u_{l,h}⟩`` per entry: the keys furthest along the layer's query direction are kept.

    Args:
        path: artifact file or directory (default: search the kvtrim home, then the shipped artifacts)
        filters: ``[layers, kv_heads, head_dim]`` directions given directly (tests, other sources) instead of an
            artifact
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False
    artifact_kind = QFILTER_KIND

    path: str | None = None
    filters: torch.Tensor | None = None
    observation: ObservationSpec = field(default_factory=ObservationSpec)
    source: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.filters is not None:
            filters = torch.as_tensor(self.filters).float()
            if filters.dim() != 3 or not bool(torch.isfinite(filters).all()):
                raise InvalidParameterError("filters must be a finite [layers, kv_heads, head_dim] tensor")
            self.filters = filters
            self.source = {"given": True}

    def bind(self, model: torch.nn.Module) -> None:
        """Load the filters of ``model`` (not when they were given directly)."""
        if self.source.get("given"):
            return
        self.filters, self.source = load_qfilters(model, self.path)

    def score(self, view: LayerView) -> torch.Tensor:
        if self.filters is None:
            raise InvalidParameterError(
                "qfilter needs the model's Q-Filters: resolve the method through kvtrim.generate, kvtrim.Session "
                "or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        layers, kv_heads, head_dim = self.filters.shape
        if view.layer_idx >= layers or view.kv_heads != kv_heads or view.keys.shape[-1] != head_dim:
            raise InvalidParameterError(
                f"the Q-Filters cover {layers} layers x {kv_heads} KV heads x {head_dim} dims but the cache has "
                f"layer {view.layer_idx} with {view.kv_heads} KV heads x {view.keys.shape[-1]}; use the artifact "
                "calibrated for this model"
            )
        u = self.filters[view.layer_idx].to(device=view.keys.device)  # [kv_heads, d]
        return torch.einsum("bhsd,hd->bhs", view.keys.float(), u)
