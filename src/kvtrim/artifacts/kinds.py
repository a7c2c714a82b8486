"""The artifact kinds kvtrim knows: what each holds and the command that produces it.

One table for every reader and every calibration (``kvtrim calibrate <kind>``); the messages of
:class:`~kvtrim.errors.MissingArtifactError` and ``kvtrim calibrate show`` read it.
"""

from __future__ import annotations

__all__ = [
    "ARTIFACT_KINDS",
    "COMPILERKV_KIND",
    "COMPRESSKV_KIND",
    "DUO_KIND",
    "EXPECTED_ATTENTION_STATS_KIND",
    "FASTKVZIP_KIND",
    "HEADKV_KIND",
    "KVZAP_KIND",
    "LUKV_KIND",
    "QFILTER_KIND",
    "RESTOREKV_KIND",
]

HEADKV_KIND = "headkv"
COMPRESSKV_KIND = "compresskv"
COMPILERKV_KIND = "compilerkv"
DUO_KIND = "duo"
KVZAP_KIND = "kvzap"
FASTKVZIP_KIND = "fastkvzip"
EXPECTED_ATTENTION_STATS_KIND = "expected_attention_stats"
QFILTER_KIND = "qfilter"
LUKV_KIND = "lukv"
RESTOREKV_KIND = "restorekv"

ARTIFACT_KINDS: dict[str, tuple[str, str]] = {
    HEADKV_KIND: ("headkv head scores", "kvtrim calibrate headkv --model {model}"),
    COMPRESSKV_KIND: (
        "CompressKV head scores (SRH/TRH) and layer error profile",
        "kvtrim calibrate compresskv --model {model}",
    ),
    COMPILERKV_KIND: ("CompilerKV compiled tables", "kvtrim calibrate compilerkv --model {model}"),
    DUO_KIND: ("DuoAttention head gates", "kvtrim calibrate duo --model {model}"),
    KVZAP_KIND: ("KVzap surrogate weights (linear and MLP)", "kvtrim calibrate kvzap --model {model}"),
    FASTKVZIP_KIND: ("Fast KVzip gate weights", "kvtrim calibrate fastkvzip --model {model}"),
    EXPECTED_ATTENTION_STATS_KIND: (
        "Expected Attention query statistics",
        "kvtrim calibrate expected_attention_stats --model {model}",
    ),
    QFILTER_KIND: ("Q-Filters key-space directions", "kvtrim calibrate qfilter --model {model}"),
    LUKV_KIND: ("LU-KV per-head budget curves", "kvtrim calibrate lukv --model {model}"),
    RESTOREKV_KIND: (
        "RestoreKV restore-token embeddings and attention LoRA",
        "kvtrim calibrate restorekv --model {model}",
    ),
}
"""``kind -> (description, command template)``; the template's ``{model}`` is the model's display name."""
