#!/usr/bin/env bash
# Set up .venv for camp2p-overlap on a fresh machine (CPU only).
#   bash scripts/setup.sh          # runtime + benchmark extras
#   bash scripts/setup.sh --test   # + test tools and the real vLLM 0.19.1 wheel,
#                                  #   and .venv-vllm026 with the real vLLM 0.26.0 wheel
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
pip() { "$VPY" -m pip --disable-pip-version-check -q "$@"; }

# The CPU build of torch. torch 2.13.0 lies on this kind of machine's disk; a
# plain "torch" requirement would pull a multi-GB CUDA build instead.
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
  pip install "torch==2.13.0"
fi

if [[ $want_test == 1 ]]; then
  pip install -e ".[test,bench]"
  # The real vLLM 0.19.1 wheel without its (CUDA) dependencies, plus what
  # vllm.plugins, vllm.envs and vllm.forward_context need to import.
  if ! "$VPY" -c 'import vllm.plugins, vllm.forward_context' >/dev/null 2>&1; then
    pip install --no-deps "vllm==0.19.1"
    pip install numpy packaging pydantic regex cbor2 huggingface_hub safetensors \
      transformers gguf aiohttp psutil pyzmq
  fi

  # The second supported stack's real vLLM 0.26.0 wheel, in a venv of its own
  # (one venv holds one vLLM): CPU torch, this package (its entry point), the
  # wheel without its dependencies, and what vllm.plugins, vllm.envs and
  # vllm.forward_context need to import. tests/test_plugin_vllm.py runs its
  # loader tests in this venv's interpreter too.
  V26=.venv-vllm026
  if [[ ! -x $V26/bin/python ]]; then
    "$PY" -m venv "$V26"
  fi
  pip26() { "$V26/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  if ! "$V26/bin/python" -c 'import torch' >/dev/null 2>&1; then
    pip26 install "torch==2.13.0"
  fi
  pip26 install -e .
  if ! "$V26/bin/python" -c 'import vllm, vllm.plugins, vllm.forward_context; assert vllm.__version__ == "0.26.0"' \
    >/dev/null 2>&1; then
    pip26 install --no-deps "vllm==0.26.0"
    pip26 install numpy packaging pydantic regex cbor2 huggingface_hub safetensors \
      transformers gguf aiohttp psutil pyzmq openai openai-harmony
  fi
else
  pip install -e ".[bench]"
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
