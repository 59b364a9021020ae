#!/usr/bin/env bash
# The one-call GPU acceptance run: on a GPU machine whose python holds a CUDA build of torch (>= 2.11) and
# Triton (>= 3.6), with no network, installs the project's other needs from the wheels `make gpu-wheels`
# fetched (wheels/), then runs the gpu-marked tests, the kernel-vs-oracle check, bench/kernel.py and a short
# bf16 training loop of the 110m model, each under its own timeout, and writes ONE JSON report to
# $OUT/gpu_check.json (when OUT is set) or bench/out/gpu_check.json. bench/gpu_check.py has the details.
#
#   bench/gpu_check.sh [--wheels DIR] [--out DIR] [--steps a,b] [--timeouts step=s,...] [--no-install]
#   bench/gpu_check.sh --dry-run     check the wheels, print the commands, write the report skeleton
#
# PYTHON picks the interpreter (default python3: on the GPU image, the one that holds torch).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"
