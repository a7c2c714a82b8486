#!/usr/bin/env bash
# Create the separate venv for kvpress (kvpress 0.5.5 needs transformers<5.3; kvtrim needs 5.23, so they cannot
# share a venv). kvtrim never imports kvpress; this venv is only for run_kvpress.py.
#
#   bash benchmarks/peer_kvpress/setup.sh            # venv at benchmarks/peer_kvpress/.venv (git-ignored)
#   KVPRESS_VENV=/some/where bash .../setup.sh       # elsewhere
#
# torch is installed FIRST and pinned to the CPU build kvtrim uses (2.13.0): an unpinned torch would pull a
# multi-GB CUDA build. kvpress's own requirement (torch>=2.3.1) is then already satisfied.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${KVPRESS_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "kvpress==0.5.5" "transformers>=5.2,<5.3"
"$VENV/bin/python" - <<'PY'
from importlib import metadata
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("kvpress", metadata.version("kvpress"), "| transformers", metadata.version("transformers"), "| torch", torch.__version__)
PY
