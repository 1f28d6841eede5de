#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md) from a checkout that is not installed, e.g. on a machine lent
# for a few minutes: the lstmem_kernels package lies in kernels/, so Python is given both the root
# (lstmem_peft) and kernels/ (lstmem_kernels). Arguments go to `lstmem bench gpu --acceptance`
# (--out DIR, --budget-s S, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in Triton's interpreter
PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m lstmem_cli bench gpu --acceptance "$@"
