#!/usr/bin/env bash
# The device check (issue 35): `bash scripts/gpu_check.sh [--cpu] OUTDIR`.
# A thin wrapper; the work and its documentation are in scripts/gpu_check.py.
# PYTHON picks the interpreter (default python3); a relative OUTDIR is taken from the caller's directory.
set -uo pipefail
export GPU_CHECK_CALLER_DIR="$PWD"
cd "$(dirname "$0")/.." || exit 1
PYTHONPATH=src exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
