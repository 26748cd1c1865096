#!/usr/bin/env bash
# Set up .venv for camp2p-overlap on a fresh machine (CPU only).
#   bash scripts/setup.sh          # runtime + benchmark extras
#   bash scripts/setup.sh --test   # + test tools and the real vLLM 0.19.1 wheel,
#                                  #   and .venv-vllm026 with the real vLLM 0.26.0 wheel
# Idempotent: re-running only installs what is missing.
# Installs with uv (from PyPI, into .venv) where it can be had, else with pip;
# SETUP_INSTALLER=pip forces pip. uv reads no pip configuration, so it is
# handed pip's sources (find-links, index URLs, constraints) and resolves as
# pip does (the best match over every index).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

# pip's configured sources as uv flags, one a line.
pip_sources='
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}
seen = []
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in flags:
        for v in value.strip().strip("\x27\"").split():
            if (flags[name], v) not in seen:
                seen.append((flags[name], v))
for flag, v in seen:
    print(flag)
    print(v)
'

UV=
UV_ARGS=()
# Install into the venv $1 (the rest: pip install's arguments), quiet.
vpip() {
  local dir=$1
  shift
  if [[ -n $UV ]]; then
    "$UV" pip install --quiet --python "$dir/bin/python" --index-strategy unsafe-best-match "${UV_ARGS[@]}" "$@"
  else
    "$dir/bin/python" -m pip --disable-pip-version-check -q install "$@"
  fi
}

# The venv $1, with the CPU build of torch. torch 2.13.0 lies on this kind of
# machine's disk; a plain "torch" requirement would pull a multi-GB CUDA build.
make_venv() {
  local dir=$1
  if [[ ! -x $dir/bin/python ]]; then
    "$PY" -m venv "$dir"
  fi
  if ! "$dir/bin/python" -c 'import torch' >/dev/null 2>&1; then
    vpip "$dir" "torch==2.13.0"
  fi
}

# The real vLLM wheel $2 in venv $1 without its (CUDA) dependencies, plus what
# vllm.plugins, vllm.envs and vllm.forward_context need to import (and the
# packages after $3); only when the import probe $3 fails.
install_vllm() {
  local dir=$1 version=$2 probe=$3
  shift 3
  if ! "$dir/bin/python" -c "$probe" >/dev/null 2>&1; then
    vpip "$dir" --no-deps "vllm==$version"
    vpip "$dir" numpy packaging pydantic regex cbor2 huggingface_hub safetensors \
      transformers gguf aiohttp psutil pyzmq "$@"
  fi
}

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
if [[ ${SETUP_INSTALLER:-uv} == uv ]]; then
  if [[ -x .venv/bin/uv ]] || .venv/bin/python -m pip --disable-pip-version-check -q install uv; then
    UV=$PWD/.venv/bin/uv
    mapfile -t UV_ARGS < <(.venv/bin/python -c "$pip_sources")
  else
    echo "setup.sh: uv could not be installed; installing with pip" >&2
  fi
fi

make_venv .venv
VPY=.venv/bin/python
if [[ $want_test == 1 ]]; then
  vpip .venv -e ".[test,bench]"
  install_vllm .venv 0.19.1 'import vllm.plugins, vllm.forward_context'

  # The second supported stack's real vLLM 0.26.0 wheel, in a venv of its own
  # (one venv holds one vLLM): CPU torch, this package (its entry point) and
  # the wheel. tests/package/test_plugin_vllm.py runs its loader tests in this venv's
  # interpreter too.
  make_venv .venv-vllm026
  vpip .venv-vllm026 -e .
  install_vllm .venv-vllm026 0.26.0 \
    'import vllm, vllm.plugins, vllm.forward_context; assert vllm.__version__ == "0.26.0"' openai openai-harmony
else
  vpip .venv -e ".[bench]"
fi
versions='
import importlib.metadata as md
for dist in ("camp2p-overlap", "torch", "wrapt", "vllm"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
'
"$VPY" -c "$versions"
if [[ $want_test == 1 ]]; then
  echo "in .venv-vllm026:"
  .venv-vllm026/bin/python -c "$versions"
fi
