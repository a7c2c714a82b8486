#!/usr/bin/env bash
# Issue 14 on a GPU in one device call: the CUDA-only tests, then the decode-step and throughput benchmarks on a
# random-weight Llama-3.1-8B shape (bf16). Prepare the bundle here first (`make gpu-bundle`: SmolLM2's tokenizer
# and the jargon haystack, no weights), then run on the device machine with `.gpu` carried:
#     bash benchmarks/gpu_issue14.sh            # results under $OUT (the device tool) or benchmarks/results/gpu_issue14
# Set STAGES to a subset of "tests step throughput" to split the work across calls (each call <= 10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_issue14}
STAGES=${STAGES:-tests step throughput}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -d .gpu/kvtrim_home ] && export KVTRIM_HOME="$PWD/.gpu/kvtrim_home"
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  $PY -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
rc=0
for stage in $STAGES; do
  case $stage in
    tests)
      $PY -m pytest -q -p no:cacheprovider -rs tests/serve/test_engine_cuda.py tests/cache/test_paged_kernels.py \
        tests/cache/test_triton_paged.py \
        > "$OUT/cuda_tests.log" 2>&1 || rc=1 ;;
    step)
      for mode in "" "--cuda-graphs"; do
        name=step${mode:+_graphs}
        $PY benchmarks/bench_decode_step.py --shape llama-8b --device cuda --dtype bfloat16 --context 2048 \
          --batches 4 32 --rate 8 --steps 30 --decode-kernel auto $mode --out-dir "$OUT/$name" \
          > "$OUT/$name.log" 2>&1 || rc=1
      done ;;
    throughput)
      $PY benchmarks/bench_serving_throughput.py --shape llama-8b --device cuda --dtype bfloat16 --lengths 2048 \
        --prompts 32 --output-tokens 128 --fit 4 --rates 1 4 8 --decode-kernel auto --cuda-graphs \
        --out-dir "$OUT/throughput" > "$OUT/throughput.log" 2>&1 || rc=1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $rc
