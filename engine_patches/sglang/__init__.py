"""SGLang plugin: ``--radix-eviction-policy rlt`` (randomized leaf-token marking, seed 004).

Loaded by SGLang itself: the entry point ``kvroute = "kvroute.engine_patches.sglang:register"`` in the
group ``sglang.srt.plugins`` runs in the launcher before argument parsing and in every server process
(``sglang.srt.plugins.load_plugins``), which then applies the registered hooks. ``register()``:

1. adds ``rlt`` to the ``--radix-eviction-policy`` choices (``add_radix_eviction_policy_choices``);
2. registers two AROUND hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``):
   ``RadixCache.__init__`` and ``UnifiedRadixCache.__init__``. They add ``rlt`` to the eviction-strategy
   factory table of ``sglang.srt.mem_cache.utils`` and, for a tree built with policy ``rlt`` only,
   select RLT's victim choice (``radix.py``, ``unified.py``). Trees with other policies are built
   exactly as SGLang ships them.

``register()`` is cheap and idempotent; importing this package imports neither torch nor SGLang.
Outside ``load_plugins`` (e.g. in a script), call ``install()``, which also applies the hooks.

Usage: ``python -m sglang.launch_server --model-path M --radix-eviction-policy rlt
[--radix-eviction-policy-config '{"seed": 0, "unit": "page"}']``. ``unit`` is what one draw evicts:
``"page"`` (default, seed 004's leaf-token draw) or ``"leaf"`` (a whole random unmarked leaf; cheaper per
eviction call, see ``strategy.RLTStrategy``).
"""

from __future__ import annotations

from typing import Any

POLICY_NAME = "rlt"
RADIX_CACHE_INIT = "sglang.srt.mem_cache.radix_cache.RadixCache.__init__"
UNIFIED_RADIX_CACHE_INIT = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__"


def _around_radix_cache_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from kvroute.engine_patches.sglang.radix import around_radix_cache_init

    around_radix_cache_init(original, self, *args, **kwargs)


def _around_unified_radix_cache_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from kvroute.engine_patches.sglang.unified import around_unified_radix_cache_init

    around_unified_radix_cache_init(original, self, *args, **kwargs)


_HOOKS = (
    (RADIX_CACHE_INIT, _around_radix_cache_init),
    (UNIFIED_RADIX_CACHE_INIT, _around_unified_radix_cache_init),
)


def register() -> None:
    """SGLang entry point (group ``sglang.srt.plugins``): add ``rlt`` and register its hooks."""
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])
    for target, hook in _HOOKS:
        registered = HookRegistry._hooks.get(target, ())
        if not any(h is hook for _, h, _ in registered):
            HookRegistry.register(target, hook, HookType.AROUND)


def install() -> None:
    """``register()`` and apply the hooks now (for use outside ``sglang.srt.plugins.load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()


__all__ = ["POLICY_NAME", "install", "register"]
