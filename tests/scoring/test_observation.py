"""Window queries recorded for scoring (kvtrim.scoring.observation.record) hold only the window."""

from __future__ import annotations

import torch

from kvtrim.cache.dense import DenseStore
from kvtrim.scoring.observation import LayerObservation, ObservationSpec, record


def test_recorded_window_holds_its_own_memory_not_the_chunks():
    """A view of the last queries would keep every chunk's queries alive until compression (per layer)."""
    spec, obs = ObservationSpec(window=4), LayerObservation()
    store = DenseStore.empty(1, 2, 8, torch.float32, "cpu")
    chunks = [torch.randn(1, 4, 100, 8), torch.randn(1, 4, 3, 8)]
    seen = 0
    for query in chunks:
        positions = torch.arange(seen, seen + query.shape[2])[None]
        record(spec, obs, store, query, positions, 0.35)
        seen += query.shape[2]
        window_bytes = 1 * 4 * 4 * 8 * 4
        assert obs.queries.untyped_storage().nbytes() == window_bytes
        assert obs.positions.untyped_storage().nbytes() == 4 * 8
    # the window spans both chunks: the last query of the first, then the three of the second
    torch.testing.assert_close(obs.queries, torch.cat([chunks[0][:, :, -1:], chunks[1]], dim=2))
    assert obs.positions.tolist() == [[99, 100, 101, 102]]
