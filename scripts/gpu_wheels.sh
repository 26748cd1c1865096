#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels scripts/gpu_check.sh installs
# offline on the GPU box (Python 3.12, x86-64 Linux), each at a pinned
# version: wrapt (compiled; the project needs >=2.5) and setuptools (pure
# Python; the editable install builds with it, --no-build-isolation, and the
# box's may be older than pyproject.toml's [build-system] requires,
# setuptools>=77). tests/hardware/test_gpu_script.py checks that both pins
# meet pyproject.toml. Into ./.whl, which git ignores: carry it to the box
# (the device tool's `carry: [".whl"]`); gpu_check.sh installs what it finds
# there with --target into a site folder first on PYTHONPATH, and reports
# the setuptools it builds with. Older wheels of the same two projects are
# removed first (two versions of one project would fail that install).
#   bash scripts/gpu_wheels.sh            # PYTHON, DEST, PYV, WRAPT, SETUPTOOLS override
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${DEST:-.whl}
PYV=${PYV:-3.12}
WRAPT=${WRAPT:-wrapt==2.5.2}
SETUPTOOLS=${SETUPTOOLS:-setuptools==80.9.0}
mkdir -p "$DEST"
new=$(mktemp -d)
trap 'rm -rf "$new"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$new" "$WRAPT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d "$new" "$SETUPTOOLS"
# Both fetched: now replace the older wheels of the two projects.
rm -f "$DEST"/wrapt-*.whl "$DEST"/setuptools-*.whl
mv "$new"/*.whl "$DEST"/
ls -l "$DEST"
