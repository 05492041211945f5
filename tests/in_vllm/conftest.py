"""Tests that run inside the vLLM venv (.venv-vllm, made by scripts/install_vllm_env.sh).

They drive vLLM's own installed code (``BlockPool``, ``KVCacheManager``, the OpenAI server). Without vLLM
they skip, unless KVROUTE_REQUIRE_ENGINES=1 (CI), where a missing engine fails them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def _require_vllm() -> None:
    try:
        import vllm.v1.core.block_pool  # noqa: F401
    except ImportError as exc:
        if os.environ.get("KVROUTE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"vLLM is required (KVROUTE_REQUIRE_ENGINES=1) but not importable: {exc}")
        pytest.skip(f"vLLM not installed: {exc}")


@pytest.fixture(scope="session")
def vllm_available() -> None:
    _require_vllm()


@pytest.fixture
def rlt(vllm_available: None) -> Iterator[None]:
    """RLT installed on vLLM's BlockPool for one test, vLLM's own methods restored afterwards."""
    from kvroute.engine_patches.vllm import block_pool_rlt

    block_pool_rlt.install()
    yield
    block_pool_rlt.uninstall()


@pytest.fixture
def stock(vllm_available: None) -> Iterator[None]:
    """vLLM's BlockPool exactly as shipped."""
    from kvroute.engine_patches.vllm import block_pool_rlt

    block_pool_rlt.uninstall()
    yield
