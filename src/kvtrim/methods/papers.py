"""Citations of the papers the methods follow (several methods cite the same paper)."""

from __future__ import annotations

STREAMING_LLM = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv 2309.17453)"
SNAPKV = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 (arXiv 2404.14469)"
PYRAMIDKV = (
    "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv 2406.02069)"
)
ADAKV = (
    "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference "
    "(arXiv 2407.11550)"
)
H2O = (
    "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023 (arXiv 2306.14048)"
)
KNORM = (
    "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, EMNLP 2024 "
    "(arXiv 2406.11430)"
)
TOVA = "Oren et al., Transformers are Multi-State RNNs (TOVA), EMNLP 2024 (arXiv 2401.06104)"
RANDOM = "Baseline used across the KV-compression literature (e.g. kvpress RandomPress)"
CRITICALKV = (
    "Feng et al., CriticalKV: Optimizing KV Cache Eviction from an Output Perturbation Perspective, ICML 2026 "
    "(arXiv 2502.03805, v1: Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective)"
)
HEADKV = (
    "Fu et al., Not All Heads Matter: A Head-Level KV Cache Compression Method with Integrated Retrieval and "
    "Reasoning, ICLR 2025 (arXiv 2410.19258)"
)
COMPRESSKV = (
    "Lin et al., CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before Generation "
    "(arXiv 2508.02401)"
)
LAGKV = (
    "Liang et al., LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important, 2025 "
    "(arXiv 2504.04704)"
)
COMPILERKV = "CompilerKV: Risk-Adaptive KV Compression via Offline Experience Compilation (arXiv 2602.08686)"
KV_COMPRESS = (
    "Rehg, KV-Compress: Paged KV-Cache Compression with Variable Compression Rates per Attention Head "
    "(arXiv 2410.00161)"
)
EXPECTED_ATTENTION = (
    "Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from Future Queries "
    "Distribution (arXiv 2510.00636); kvpress ExpectedAttentionPress"
)
KEYDIFF = (
    "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in "
    "Resource-Constrained Environments (arXiv 2504.15364)"
)
CHUNKKV = (
    "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference "
    "(arXiv 2502.00299)"
)
KVZIP = (
    "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, NeurIPS 2025 "
    "(arXiv 2505.23416)"
)
KVZAP = "Jegou & Jeblick, KVzap: Fast, Adaptive, and Faithful KV Cache Pruning (arXiv 2601.07891); kvpress KVzapPress"
FASTKVZIP = (
    "Kim, Han & Yun, Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction (arXiv 2601.17668); "
    "kvpress FastKVzipPress"
)
RESTOREKV = (
    "RestoreKV, learned restoration on top of KVzip (arXiv 2608.01247); Kim et al., KVzip: Query-Agnostic KV Cache "
    "Compression with Context Reconstruction (arXiv 2505.23416); kvpress RestoreKVPress"
)
THINK = "Xu et al., ThinK: Thinner Key Cache by Query-Driven Pruning, ICLR 2025 (arXiv 2407.21018)"
DUO_ATTENTION = (
    "Xiao et al., DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads, "
    "ICLR 2025 (arXiv 2410.10819)"
)
CURDKV = (
    "Sengupta et al., Value-Guided KV Compression for LLMs via Approximated CUR Decomposition (arXiv 2509.15038); "
    "kvpress CURPress"
)
COMPACTOR = (
    "Chari & Van Durme, Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores "
    "(arXiv 2507.08143); kvpress LeverageScorePress, NonCausalAttnPress, CompactorPress"
)
DMS = (
    "Łańcucki et al., Inference-Time Hyper-Scaling with KV Cache Compression (arXiv 2506.05345); kvpress DMSPress "
    "(threshold eviction without the trained evictor)"
)
CAPKV = (
    "CapKV: Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective (arXiv 2604.25975); kvpress "
    "CapPress"
)
SIMLAYERKV = (
    "Zhang et al., SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction (arXiv 2410.13846); kvpress "
    "SimLayerKVPress"
)
BLOCK = f"{KEYDIFF}, block prompt processing; kvpress BlockPress"
FINCH = (
    "Corallo & Papotti, FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models, TACL 2024; "
    "kvpress ChunkPress"
)
RKV = (
    "Cai et al., R-KV: Redundancy-aware KV Cache Compression for Reasoning Models (arXiv 2505.24133); "
    "Zefan-Cai/R-KV"
)
FINCH_PROMPT = (
    "Corallo & Papotti, FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models, TACL 2024 "
    "(doi 10.1162/tacl_a_00716, arXiv 2408.00167); kvpress FinchPress"
)
KVCOMPOSE = (
    "Akulov et al., KVCompose: Efficient Structured KV Cache Compression with Composite Tokens (arXiv 2509.05165); "
    "kvpress KVComposePress"
)
MERGING = (
    "kvpress MergingPress (no paper of its own): merge on evict after Wan et al., D2O: Dynamic Discriminative "
    "Operations for Efficient Long-Context Inference of Large Language Models (arXiv 2406.13035) and Bolya et al., "
    "Token Merging: Your ViT But Faster, ICLR 2023 (arXiv 2210.09461)"
)
CAM = (
    "Zhang et al., CaM: Cache Merging for Memory-efficient LLMs Inference, ICML 2024 "
    "(openreview.net/forum?id=LCTmppB165); kvpress CAMPress"
)
KEY_REROTATION = (
    "Corallo & Papotti, FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models, TACL 2024 "
    "(arXiv 2408.00167), whose key re-rotation after eviction kvpress's KeyRerotationPress offers for any press; "
    "Xiao et al., Efficient Streaming Language Models with Attention Sinks (its rolling cache), ICLR 2024 "
    "(arXiv 2309.17453)"
)
KVGRAD = (
    "KVgrad (OpenReview, openreview.net/forum?id=cg1wTCJjjk; the method as kvpress's KVgradPress describes it): "
    "input × gradient attribution over KVzip's context reconstruction"
)
TRIATTENTION = (
    "Mao et al., TriAttention: Efficient Long Reasoning with Trigonometric KV Compression (arXiv 2604.04921)"
)
QFILTERS = (
    "Godey et al., Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value Cache Compression "
    "(arXiv 2503.02812); kvpress QFilterPress"
)
LUKV = (
    "Tang et al., Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache Eviction "
    "(arXiv 2602.08585); kvpress LUKVPress"
)
