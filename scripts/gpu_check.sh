#!/usr/bin/env bash
# The GPU check: the demo's stages on a CUDA device at small sizes (lossless engine, answers with teacher
# and features, the engine's benchmark, distillation under torchrun with NCCL), printed as one table.
#   scripts/gpu_check.sh [--prompts 32 --max-new-tokens 64 --steps 20 --only lossless,answers,bench,distill]
# Needs a CUDA build of torch in .venv (or $PYTHON) and a GPU; without one it says so and exits 2.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [[ ! -x "$PYTHON" ]]; then
    echo "gpu_check: $PYTHON not found: run 'make install' first (or set PYTHON)" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees none" \
         "(a CPU build of torch, or no GPU here). This check needs a GPU; on a CPU, 'make test' covers the same code." >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec "$PYTHON" scripts/gpu_check.py --device "${GPU_CHECK_DEVICE:-cuda}" "$@"
