#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 with the Python packages its radix-cache classes and argument parser
# import, pytest + hypothesis, and kvroute (editable, which registers the `sglang.srt.plugins` entry point).
# tests/in_sglang/ runs in it (scripts/test.sh). Idempotent: a venv made by the same recipe is kept.
#
# Why not `pip install sglang`: its full dependency set pulls CUDA kernel packages (flashinfer, deep-gemm,
# ...) that this CPU machine neither needs nor can use. torch/torchvision come first at the versions
# sglang pins (they lie on local disk here), then sglang without deps, then its import deps at the
# versions sglang asks for.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVROUTE_SGLANG_VENV:-.venv-sglang}
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

RECIPE="sglang==0.5.23 torch==2.14.1 torchvision==0.29.1 recipe-2"
SOURCES=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
STAMP="$VENV/.kvroute-sglang-recipe"
WANT="$RECIPE $SOURCES"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
  && "$VENV/bin/python" -c "
import importlib.metadata as md, importlib.util as iu
assert md.version('sglang') == '0.5.23' and iu.find_spec('kvroute.engine_patches.sglang')
import kvroute.cython_ext.page_draws  # the compiled extension the plugin uses
assert any(ep.name == 'kvroute' for ep in md.entry_points(group='sglang.srt.plugins'))
" 2>/dev/null; then
  echo "$VENV is up to date"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
  ipython aiohttp dill gguf partial_json_parser "python-dateutil<3" \
  transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
  compressed-tensors==0.18.0 openai==2.8.0 \
  pytest hypothesis pytest-timeout
"${PIP[@]}" -e . "python-dateutil<3"
# sglang's import chain must resolve without stubs (the cache classes, the server args, the plugin)
"$VENV/bin/python" -W ignore -c "
import sglang.srt.plugins, sglang.srt.server_args
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
import kvroute.engine_patches.sglang, kvroute.cython_ext.page_draws
"
echo "$WANT" >"$STAMP"
echo "$VENV ready in $(($(date +%s) - start)) s"
