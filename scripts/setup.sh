#!/usr/bin/env bash
# Sets up .venv on a fresh machine (idempotent): the CPU torch wheel first (an unpinned torch would pull CUDA),
# then moecompile in editable mode with its test extra, at the versions CI tests (scripts/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[test]"
