"""RLT for SGLang's server tree, ``UnifiedRadixCache`` (``sglang.srt.mem_cache.unified_radix_cache``).

With ``eviction_policy="rlt"`` the cache is built with SGLang's own extension points:
- tree core: ``RLTUnifiedTreeCore``, the Python ``UnifiedTreeCore`` plus marking, registered with
  ``register_tree_core_backend`` and selected through ``CacheInitParams.tree_core_backend`` (the Rust core
  refuses unknown policies);
- FULL component: ``RLT<FullComponent>`` through ``component_registry_override``; its
  ``_evict_device_*`` walk hands SGLang's eviction loop the leaves RLT picks.
SGLang's loop then evicts each victim with its own code (frees, KV events, HiCache demotion, cascades).
Any other policy builds SGLang's classes unchanged.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch
from kvroute.cython_ext.page_draws import PageDraws
from kvroute.engine_patches.sglang.rlt_core import (
    UNMARKED,
    RLTLeafSet,
    RLTPhase,
    cut_key_tail,
    draw_leaf,
    draw_pages,
    mark_path,
)
from kvroute.engine_patches.sglang.strategy import POLICY_NAME, RLTStrategy, resolve_capacity
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    get_tree_core_factory,
    register_tree_core_backend,
)
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
from sglang.srt.mem_cache.unified_radix_cache import COMPONENT_REGISTRY, UnifiedRadixCache

TREE_CORE_BACKEND = "kvroute_rlt"
FULL = ComponentType.FULL


class RLTUnifiedTreeCore(UnifiedTreeCore):
    """SGLang's Python tree core, marking every path an access touches. ``evictable_device_leaves`` is
    an ``RLTLeafSet`` (exactly SGLang's set, plus the indexed candidate array)."""

    def __init__(self, params: Any, components: dict) -> None:
        self._rlt_phase: RLTPhase | None = None
        self._rlt_allocator = params.token_to_kv_pool_allocator
        super().__init__(params, components)

    def reset(self) -> None:
        super().reset()
        if self._rlt_phase is None:
            strategy = self.eviction_strategy
            if not isinstance(strategy, RLTStrategy):
                raise ValueError(
                    f"tree core {TREE_CORE_BACKEND!r} serves --radix-eviction-policy {POLICY_NAME} only, "
                    f"got strategy {type(strategy).__name__}"
                )
            self._rlt_phase = RLTPhase(resolve_capacity(strategy, self._rlt_allocator))
            self.rlt_rng = PageDraws(strategy.seed)
            self.rlt_unit = strategy.unit
            self.rlt_randbelow = random.Random(strategy.seed).randrange
        else:
            self._rlt_phase.start_new()
        self.evictable_device_leaves = RLTLeafSet(self._rlt_phase, self.evictable_device_leaves)

    @property
    def rlt_phase(self) -> RLTPhase:
        assert self._rlt_phase is not None
        return self._rlt_phase

    def _match_post_processor(self, params: Any, value: Any, best_match_node: Any, *args: Any, **kwargs: Any):
        result = super()._match_post_processor(params, value, best_match_node, *args, **kwargs)
        mark_path(best_match_node, self.root_node, self.rlt_phase, self.evictable_device_leaves)
        return result

    def _insert_tail_step(self, state: Any) -> None:
        super()._insert_tail_step(state)
        mark_path(state.target_node, self.root_node, self.rlt_phase, self.evictable_device_leaves)

    def rlt_in_place_trim_allowed(self) -> bool:
        """Whether a leaf's tail may be cut in place: only FULL device KV, nothing that names nodes or
        pages outside the tree (KV events, HiCache host copies, storage, external linker)."""
        return (
            tuple(self.component_types) == (FULL,)
            and not self.kv_events.enabled
            and not self.enable_hicache
            and not self.enable_storage
            and not self.enable_external_cache_linker
        )

    def rlt_node_trimmable(self, node: Any) -> bool:
        return (
            node.component_data[FULL].host_value is None
            and node.write_through_pending_id is None
            and node.load_back_pending_id is None
        )

    def rlt_trim_tail(self, node: Any, keep: int) -> Any:
        """Cut an unlocked device leaf after its first ``keep`` tokens (a page multiple), in place;
        returns the slots cut. Parent, child key (the first page) and leaf status are unchanged."""
        cd = node.component_data[FULL]
        value = cd.value
        tail = value[keep:]
        cd.value = value[:keep]
        cut_key_tail(node, keep, self.page_size)
        self.component_evictable_size_[FULL] -= tail.shape[0]
        return tail

    def _split_node(self, key: Any, child: Any, split_len: int):
        new_node, action = super()._split_node(key, child, split_len)
        phase = getattr(child, "_rlt_phase", UNMARKED)
        if phase != UNMARKED:  # the new parent holds tokens of the same access: same mark
            new_node._rlt_phase = phase
            self.evictable_device_leaves.on_marked(new_node)
        return new_node, action


def _rlt_tree_core_factory(params: Any, components: dict) -> RLTUnifiedTreeCore:
    return RLTUnifiedTreeCore(params, components)


class RLTFullComponentMixin:
    """The FULL component's device-eviction walk, by RLT.

    A walk runs in rounds. A round's quota is the pages still missing (the allocator's shortfall when
    SGLang evicts for an allocation, else the walk's request); its draws are simulated by
    ``draw_pages``. A leaf whose last page is drawn is handed to SGLang's loop at once (its parent may
    become a candidate); at the end of the round every other drawn leaf is split so that its drawn
    pages form a leaf of their own, which is handed over in turn. SGLang re-checks its target after
    each victim, as with LRU.
    """

    def _evict_device_start(self, request_cnt: int) -> None:
        self._evict_device_request_cnt = request_cnt
        self._rlt_round_left = 0  # pages still to draw in the current round
        self._rlt_taken: dict[Any, int] = {}  # pages drawn per leaf, not yet handed over
        self._rlt_trims: list[tuple[Any, int]] = []  # (leaf, pages) to split off and hand over

    def _evict_device_end(self) -> None:
        self._rlt_round_left = 0
        self._rlt_taken = {}
        self._rlt_trims = []

    def _rlt_missing_pages(self, tracker: dict) -> int:
        page = self.tree_core.page_size
        target = getattr(self.cache, "_rlt_full_target", None)
        if target is not None:  # allocation-driven: what the allocator still lacks
            missing = target - self.cache._component_available_size(FULL)
        else:
            missing = self._evict_device_request_cnt - tracker[FULL]
        return max(0, -(-missing // page))

    def _evict_device_next_node(
        self, tracker: dict, device_frees: dict, host_frees: dict, cache_actions: list
    ) -> Any:
        core: RLTUnifiedTreeCore = self.tree_core
        leaves: RLTLeafSet = core.evictable_device_leaves
        if core.rlt_unit == "leaf":  # a whole random unmarked leaf per victim, SGLang evicts it
            if tracker[FULL] >= self._evict_device_request_cnt:
                return None
            node = draw_leaf(leaves, core.rlt_phase, core.rlt_randbelow)
            return None if node is None else node.id
        page = core.page_size
        while True:
            if self._rlt_trims:
                node, n_pages = self._rlt_trims.pop()
                if node not in leaves:
                    continue
                keep = len(node.key) - n_pages * page
                if keep > 0:
                    _, action = core._split_node(node.key, node, keep)  # node keeps the tail
                    if action is not None:
                        cache_actions.append(action)
                return node.id
            if self._rlt_round_left <= 0:
                if self._rlt_taken:
                    if self._rlt_flush_round(tracker, device_frees):
                        return None  # trimmed in place: progress without a victim node
                    continue
                if tracker[FULL] >= self._evict_device_request_cnt:
                    return None
                self._rlt_round_left = self._rlt_missing_pages(tracker)
                if self._rlt_round_left <= 0:
                    return None
            candidates = leaves.unmarked()
            if not candidates:
                if not len(leaves):
                    self._rlt_round_left = 0
                    if self._rlt_taken:
                        continue  # hand over what was drawn, then stop
                    return None
                core.rlt_phase.start_new()  # no unmarked leaf left: new phase
                leaves.on_new_phase()
                continue
            taken_by_node = self._rlt_taken
            room = np.fromiter(
                (n.component_data[FULL].value.shape[0] // page - taken_by_node.get(n, 0) for n in candidates),
                dtype=np.int64,
                count=len(candidates),
            )
            taken, n_draws, emptied = draw_pages(core.rlt_rng, room, self._rlt_round_left)
            self._rlt_round_left -= n_draws
            for i in np.flatnonzero(taken).tolist():
                node = candidates[i]
                taken_by_node[node] = taken_by_node.get(node, 0) + int(taken[i])
            if emptied >= 0:
                node = candidates[emptied]
                del taken_by_node[node]
                return node.id  # the whole leaf goes; SGLang evicts it
            self._rlt_round_left = 0

    def _rlt_flush_round(self, tracker: dict, device_frees: dict) -> bool:
        """End a round: cut the drawn pages off their leaves. Where the tree holds nothing but FULL KV
        on the device (no HiCache, storage, KV events, SWA/Mamba data), a leaf's tail is cut in place
        and its slots go to ``device_frees`` in one step; elsewhere the leaf is split so the drawn
        pages form a leaf of their own that SGLang's loop evicts (queued in ``_rlt_trims``). Returns
        whether anything was cut in place."""
        core: RLTUnifiedTreeCore = self.tree_core
        page = core.page_size
        in_place = core.rlt_in_place_trim_allowed()
        tails = []
        leaves = core.evictable_device_leaves
        for node, n_pages in self._rlt_taken.items():
            if node not in leaves:  # no longer an unlocked device leaf: its draws lapse
                continue
            keep = len(node.key) - n_pages * page
            if in_place and keep > 0 and core.rlt_node_trimmable(node):
                tails.append(core.rlt_trim_tail(node, keep))
            else:
                self._rlt_trims.append((node, n_pages))
        self._rlt_taken = {}
        if not tails:
            return False
        freed = torch.cat(tails)
        device_frees[FULL].append(freed)
        tracker[FULL] += int(freed.numel())
        return True


_RLT_FULL_CLASSES: dict[type, type] = {}


def rlt_full_component_class(cls: type) -> type:
    if not issubclass(cls, FullComponent):
        raise TypeError(f"rlt needs the FULL component to be a FullComponent, got {cls.__name__}")
    rlt_cls = _RLT_FULL_CLASSES.get(cls)
    if rlt_cls is None:
        rlt_cls = type(f"RLT{cls.__name__}", (RLTFullComponentMixin, cls), {"__module__": __name__})
        _RLT_FULL_CLASSES[cls] = rlt_cls
    return rlt_cls


def _make_rlt_cache_class(cls: type) -> type:
    class RLTUnifiedRadixCache(cls):  # per SGLang class: zero-arg super() and the same layout
        """Remembers the FULL availability target of an allocation-driven eviction, so RLT draws the
        pages the allocator still lacks (SGLang's LRU walk checks the same target after each victim)."""

        kvroute_rlt = True
        _rlt_full_target: int | None = None

        def evict_for_alloc(self, params: Any, *, allocation_reclaim_satisfied: Any = None) -> Any:
            if allocation_reclaim_satisfied is None and params.num_tokens > 0:
                self._rlt_full_target = self._component_available_size(FULL) + params.num_tokens
            try:
                return super().evict_for_alloc(
                    params, allocation_reclaim_satisfied=allocation_reclaim_satisfied
                )
            finally:
                self._rlt_full_target = None

    RLTUnifiedRadixCache.__name__ = RLTUnifiedRadixCache.__qualname__ = f"RLT{cls.__name__}"
    RLTUnifiedRadixCache.__module__ = __name__
    return RLTUnifiedRadixCache


_RLT_CACHE_CLASSES: dict[type, type] = {}


def rlt_cache_class(cls: type) -> type:
    rlt_cls = _RLT_CACHE_CLASSES.get(cls)
    if rlt_cls is None:
        rlt_cls = _make_rlt_cache_class(cls)
        _RLT_CACHE_CLASSES[cls] = rlt_cls
    return rlt_cls


def ensure_tree_core_backend() -> None:
    if get_tree_core_factory(TREE_CORE_BACKEND) is None:
        register_tree_core_backend(TREE_CORE_BACKEND, _rlt_tree_core_factory)


def rlt_params(params: Any) -> Any:
    """``params`` with the RLT tree core and FULL component selected (a copy; the caller's is kept)."""
    if params.enable_session_radix_cache:
        raise ValueError("--radix-eviction-policy rlt does not support --enable-session-radix-cache")
    ensure_tree_core_backend()
    override = dict(params.component_registry_override or {})
    full_cls = override.get(FULL, COMPONENT_REGISTRY[FULL])
    override[FULL] = rlt_full_component_class(full_cls)
    return dataclasses.replace(
        params, component_registry_override=override, tree_core_backend=TREE_CORE_BACKEND
    )


def around_unified_radix_cache_init(original: Any, self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook on ``UnifiedRadixCache.__init__``: an ``rlt`` cache gets RLT's core and FULL walk."""
    from kvroute.engine_patches.sglang.strategy import install_factory_entry

    install_factory_entry()
    is_rlt = not params.disable and str(params.eviction_policy).lower() == POLICY_NAME
    if is_rlt:
        params = rlt_params(params)
    original(self, params, *args, **kwargs)
    if is_rlt and not getattr(self, "kvroute_rlt", False):
        self.__class__ = rlt_cache_class(type(self))


__all__ = [
    "TREE_CORE_BACKEND",
    "RLTUnifiedTreeCore",
    "RLTFullComponentMixin",
    "UnifiedRadixCache",
    "around_unified_radix_cache_init",
    "rlt_full_component_class",
]
