#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run every test. Exit non-zero on any failure.
#
#   .venv          kvroute + test tools + Ray          -> pytest tests/ (all but tests/in_*/)
#   .venv-<name>   made by scripts/install_<name>_env.sh (an engine in its own venv, as users run it)
#                                                      -> that venv's pytest on tests/in_<name>/
# KVROUTE_REQUIRE_ENGINES=1 turns a missing engine venv into a test failure instead of a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -e '.[test,ray]'

for installer in scripts/install_*_env.sh; do
  [ -e "$installer" ] || continue
  echo "== $installer"
  bash "$installer"
done

export KVROUTE_REQUIRE_ENGINES=${KVROUTE_REQUIRE_ENGINES:-1}
status=0
ignore=()
for d in tests/in_*/; do [ -d "$d" ] && ignore+=("--ignore=$d"); done
.venv/bin/python -m pytest -q "${ignore[@]}" tests || status=1
for d in tests/in_*/; do
  [ -d "$d" ] || continue
  name=$(basename "$d"); name=${name#in_}
  echo "== tests/in_$name with .venv-$name"
  ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider "$d" || status=1
done
exit $status
