#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md) from a checkout that is not installed, e.g. on a machine lent
# for a few minutes: kernels/ is importable only as lstmem_kernels, so a temporary folder links that
# name to it. Arguments go to `lstmem bench gpu --acceptance` (--out DIR, --budget-s S, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
links="$(mktemp -d)"
ln -s "$PWD/kernels" "$links/lstmem_kernels"
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in Triton's interpreter
PYTHONPATH="$PWD:$links${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m lstmem_peft.cli.commands bench gpu --acceptance "$@"
