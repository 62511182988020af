#!/usr/bin/env bash
# The device check (tests/device/cuda_check.py: issues 41 and 65), in two steps:
#   here, with the network:            bash tests/device/run.sh wheels
#   on the lent GPU machine (no network), through the device tool's `run` with carry [".whl"]:
#                                      HBMWATCH_COMMIT=<the checkout's commit> bash tests/device/run.sh check
# The machine has torch, psutil, prometheus-client and nvidia-ml-py; the watchdog's other light
# dependencies travel as wheels, and the watchdog itself is this checkout, on PYTHONPATH. The
# check takes under 6 minutes and writes $OUT/README.md, $OUT/report.json and $OUT/fixtures/
# (seven files: what the device tool brings back). HBMWATCH_COMMIT names the commit in the report:
# the tree travels there without its .git.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  wheels)
    exclude="$(git rev-parse --git-path info/exclude)"  # a worktree's .git is a file
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl structlog==26.1.0 apscheduler==3.11.3 tzlocal==5.4.5
    ls .whl ;;
  check)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    timeout 350 python3 tests/device/cuda_check.py --out "${OUT:-cuda-check}" ;;
  *)
    echo "usage: bash tests/device/run.sh wheels|check" >&2
    exit 2 ;;
esac
