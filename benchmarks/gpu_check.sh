#!/usr/bin/env bash
# The GPU check in stages (docs/gpu-check.md): bash benchmarks/gpu_check.sh STAGE [STAGE ...] [options]
# Stages: tests, kernels (the paged decode kernels: gather, Triton over float blocks, the fused dequantizing Triton
# kernel over int8 / int4 / fp8 blocks), methods, step, throughput; each writes gpu_check_<stage>.json and .md to
# $OUT when set (else benchmarks/results/gpu_check/<stage>/) and prints a one-screen summary. Prepare `.gpu` here first
# (`make gpu-bundle`: SmolLM2's tokenizer, the jargon haystack, pytest wheels) and carry it to the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .gpu/kvtrim_home ]; then export KVTRIM_HOME="$PWD/.gpu/kvtrim_home"; fi
exec "${PY:-python3}" benchmarks/gpu_check.py "$@"
