#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels scripts/gpu_check.sh installs
# offline on the GPU box (Python 3.12, x86-64 Linux): wrapt>=2.5 (compiled)
# and setuptools>=77 (pure Python; the editable install needs it, and the
# box's may be older). Into ./.whl, which git ignores: carry it to the box
# (the device tool's `carry: [".whl"]`); gpu_check.sh installs what it finds
# there with --target into a site folder first on PYTHONPATH.
#   bash scripts/gpu_wheels.sh            # PYTHON, DEST, PYV, WRAPT, SETUPTOOLS override
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${DEST:-.whl}
PYV=${PYV:-3.12}
WRAPT=${WRAPT:-wrapt==2.5.2}
SETUPTOOLS=${SETUPTOOLS:-setuptools==80.9.0}
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "$WRAPT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d "$DEST" "$SETUPTOOLS"
ls -l "$DEST"
