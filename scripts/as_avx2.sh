#!/usr/bin/env bash
# Run a command as it would run on an AVX2-only x86 CPU (no AVX-512, no native bf16), on any x86 machine:
#   scripts/as_avx2.sh make test
#   scripts/as_avx2.sh .venv/bin/specdistill demo
# The library decides from SPECDISTILL_CPU_FLAGS (this CPU's flags without avx512*/amx*/avx_ne_convert:
# dtype auto = fp32, no oneDNN packing), and PyTorch, oneDNN and MKL are capped at AVX2 kernels, so a
# bf16 weight reorder fails here exactly as on an AVX2 machine. Clock speed and cache sizes stay this
# machine's: speeds measured this way are indicative, not an AVX2 machine's.
set -euo pipefail
flags="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | grep -v -E '^(avx512|amx|avx_ne_convert|avx_vnni)' | tr '\n' ' ')"
export SPECDISTILL_CPU_FLAGS="${flags}"
export ATEN_CPU_CAPABILITY=avx2
export ONEDNN_MAX_CPU_ISA=AVX2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export SPECDISTILL_LLAMA_CPP_ISA=avx2  # llama-server built for AVX2 only (cached apart from the native build)
echo "as_avx2: library flags without AVX-512/AMX; ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 SPECDISTILL_LLAMA_CPP_ISA=avx2" >&2
exec "$@"
