"""kvroute's vLLM plugin: RLT eviction inside vLLM V1's prefix-cache block pool.

Registered in the entry-point group ``vllm.general_plugins`` (pyproject.toml), which vLLM runs in every
process it starts (API server, engine core, workers), possibly more than once: ``register`` is cheap and
idempotent, and imports nothing of vLLM unless RLT is selected.

vLLM's CLI cannot be extended by a plugin, so the policy comes from the environment:

    KVROUTE_EVICTION=rlt   the block pool reuses a uniformly random unmarked leaf cached block
    KVROUTE_EVICTION=lru   (or unset) vLLM is left completely untouched: its own LRU free queue
    KVROUTE_RLT_SEED=N     optional: seed RLT's draws (reproducible runs)

    KVROUTE_EVICTION=rlt python -m vllm.entrypoints.openai.api_server --model ... --enable-prefix-caching
"""

from __future__ import annotations

import os

EVICTION_ENV = "KVROUTE_EVICTION"
POLICIES = ("lru", "rlt")


def selected_policy() -> str:
    """The eviction policy named by KVROUTE_EVICTION ("lru" when unset). ValueError on anything else."""
    raw = os.environ.get(EVICTION_ENV, "").strip().lower()
    if raw == "":
        return "lru"
    if raw not in POLICIES:
        raise ValueError(f"{EVICTION_ENV} must be one of {', '.join(POLICIES)} (or unset), got {raw!r}")
    return raw


def register() -> None:
    """vLLM plugin entry point: install RLT into ``BlockPool`` when KVROUTE_EVICTION=rlt."""
    if selected_policy() != "rlt":
        return
    from kvroute.engine_patches.vllm.block_pool_rlt import install

    install()
