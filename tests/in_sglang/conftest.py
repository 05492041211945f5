"""Tests that run inside the SGLang venv (.venv-sglang, made by scripts/install_sglang_env.sh).

Without SGLang they skip, unless KVROUTE_REQUIRE_ENGINES=1 (CI), where a missing engine fails them.
The plugin is loaded the way SGLang loads it: ``sglang.srt.plugins.load_plugins()`` over the installed
entry points.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def sglang_plugin() -> None:
    try:
        import sglang.srt.plugins  # noqa: F401
    except ImportError as exc:
        if os.environ.get("KVROUTE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"SGLang is required (KVROUTE_REQUIRE_ENGINES=1) but not importable: {exc}")
        pytest.skip(f"SGLang not installed: {exc}")
    from kvroute.bench.engine_evict_sglang import load_plugin

    load_plugin()
