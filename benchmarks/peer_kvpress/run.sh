#!/usr/bin/env bash
# Run both sides of the kvtrim/kvpress bytes comparison and write the report.
#
#   bash benchmarks/peer_kvpress/run.sh                       # from the repo root, after `make install` and setup.sh
#   RATIOS=0.5 SAMPLES=1 bash benchmarks/peer_kvpress/run.sh  # quick
#
# Env: KVTRIM_PY (default .venv/bin/python), KVPRESS_VENV (default benchmarks/peer_kvpress/.venv),
#      OUT (default benchmarks/results/peer_kvpress), RATIOS (0.5,0.75,0.9), SAMPLES (3), THREADS (1).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
KVTRIM_PY="${KVTRIM_PY:-$ROOT/.venv/bin/python}"
KVPRESS_PY="${KVPRESS_VENV:-$HERE/.venv}/bin/python"
OUT="${OUT:-$ROOT/benchmarks/results/peer_kvpress}"
RATIOS="${RATIOS:-0.5,0.75,0.9}"
SAMPLES="${SAMPLES:-3}"
THREADS="${THREADS:-1}"

test -x "$KVTRIM_PY" || { echo "kvtrim venv missing ($KVTRIM_PY): run 'make install' first" >&2; exit 1; }
test -x "$KVPRESS_PY" || { echo "kvpress venv missing ($KVPRESS_PY): run 'bash $HERE/setup.sh' first" >&2; exit 1; }
mkdir -p "$OUT"

"$KVTRIM_PY" "$HERE/make_prompt.py" --out "$OUT/prompt.json" --samples "$SAMPLES"
"$KVTRIM_PY" "$HERE/run_kvtrim.py" --prompt "$OUT/prompt.json" --out "$OUT/kvtrim.json" \
    --ratios "$RATIOS" --threads "$THREADS"
"$KVPRESS_PY" "$HERE/run_kvpress.py" --prompt "$OUT/prompt.json" --out "$OUT/kvpress.json" \
    --ratios "$RATIOS" --threads "$THREADS"
"$KVTRIM_PY" "$HERE/report.py" --dir "$OUT"
