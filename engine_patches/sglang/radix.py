"""RLT for SGLang's legacy ``RadixCache`` (``sglang.srt.mem_cache.radix_cache``).

An instance built with ``eviction_policy="rlt"`` gets its class switched to ``RLT<its class>``, a
subclass that marks the paths ``match_prefix``/``insert`` touch and replaces ``evict``. Instances with
any other policy keep SGLang's class untouched. Only SGLang's own tree operations change the tree
(``_split_node``, ``_delete_leaf``, the allocator's ``free_segment``, the KV-event recorder).
"""

from __future__ import annotations

import random
import time
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
from kvroute.engine_patches.sglang.strategy import RLTStrategy, resolve_capacity
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache

_RLT_CLASSES: dict[type, type] = {}


def _make_rlt_class(cls: type) -> type:
    class RLTRadixCache(cls):  # defined per SGLang class: zero-arg super() and the same layout
        """RLT victim choice for ``RadixCache`` (and subclasses). Invariants: ``evictable_leaves`` is an
        ``RLTLeafSet`` holding exactly SGLang's evictable leaves; marked nodes are closed under parent."""

        kvroute_rlt = True
        _rlt_phase: RLTPhase
        _rlt_rng: PageDraws

        def _rlt_setup(self) -> None:
            strategy = self.eviction_strategy
            if not isinstance(strategy, RLTStrategy):
                raise TypeError(f"rlt tree built with strategy {type(strategy).__name__}")
            self._rlt_phase = RLTPhase(resolve_capacity(strategy, self.token_to_kv_pool_allocator))
            self._rlt_rng = PageDraws(strategy.seed)
            self._rlt_unit = strategy.unit
            self._rlt_randbelow = random.Random(strategy.seed).randrange
            self.evictable_leaves = RLTLeafSet(self._rlt_phase, self.evictable_leaves)

        # -- marking -------------------------------------------------------------------------------------
        def reset(self) -> None:
            super().reset()
            phase = getattr(self, "_rlt_phase", None)
            if phase is not None:
                phase.start_new()
                self.evictable_leaves.on_new_phase()

        def _match_prefix_helper(self, node: Any, key: Any) -> tuple[list, Any]:
            value, last_node = super()._match_prefix_helper(node, key)
            mark_path(last_node, self.root_node, self._rlt_phase, self.evictable_leaves)
            return value, last_node

        def _insert_helper(self, node: Any, key: Any, value: Any, priority: int = 0, inserted_len: int = 0):
            prefix_len, last_node = super()._insert_helper(node, key, value, priority, inserted_len)
            mark_path(last_node, self.root_node, self._rlt_phase, self.evictable_leaves)
            return prefix_len, last_node

        def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
            new_node = super()._split_node(key, child, split_len)
            new_node._rlt_phase = getattr(child, "_rlt_phase", UNMARKED)  # the prefix shares the mark
            return new_node

        # -- eviction ------------------------------------------------------------------------------------
        def evict(self, params: EvictParams) -> EvictResult:
            if self.disable:
                return EvictResult()
            start_time = time.perf_counter()
            if params.num_tokens <= 0:
                return EvictResult(num_tokens_evicted=0)
            if self._rlt_unit == "leaf":
                num_evicted = self._rlt_evict_leaves(params.num_tokens)
            else:
                num_evicted = self._rlt_evict_pages(-(-params.num_tokens // self.page_size))
            self.update_eviction_metrics(num_evicted, start_time)
            return EvictResult(num_tokens_evicted=num_evicted)

        def _rlt_evict_leaves(self, num_tokens: int) -> int:
            """``unit="leaf"``: evict random unmarked leaves whole until ``num_tokens`` are freed (or
            nothing is evictable); returns tokens."""
            leaves: RLTLeafSet = self.evictable_leaves
            evicted = 0
            while evicted < num_tokens:
                node = draw_leaf(leaves, self._rlt_phase, self._rlt_randbelow)
                if node is None:
                    break
                evicted += self._rlt_delete_leaf(node)  # its parent may become a candidate
            return evicted

        def _rlt_evict_pages(self, quota_pages: int) -> int:
            """Draw ``quota_pages`` pages (or until nothing is evictable) and evict them; returns tokens."""
            leaves: RLTLeafSet = self.evictable_leaves
            phase = self._rlt_phase
            page = self.page_size
            taken_by_node: dict[Any, int] = {}
            drawn = 0
            evicted = 0
            while drawn < quota_pages:
                candidates = leaves.unmarked()
                if not candidates:
                    if not len(leaves):
                        break
                    phase.start_new()  # no unmarked leaf left: new phase, everything is a candidate
                    leaves.on_new_phase()
                    continue
                room = np.fromiter(
                    (n.value.shape[0] // page - taken_by_node.get(n, 0) for n in candidates),
                    dtype=np.int64,
                    count=len(candidates),
                )
                taken, n_draws, emptied = draw_pages(self._rlt_rng, room, quota_pages - drawn)
                drawn += n_draws
                for i in np.flatnonzero(taken).tolist():
                    node = candidates[i]
                    taken_by_node[node] = taken_by_node.get(node, 0) + int(taken[i])
                if emptied >= 0:
                    node = candidates[emptied]
                    del taken_by_node[node]
                    evicted += self._rlt_delete_leaf(node)  # its parent may become a candidate
            tails = []
            for node, n_pages in taken_by_node.items():
                keep = len(node.key) - n_pages * page
                if keep <= 0:
                    evicted += self._rlt_delete_leaf(node)
                elif self.kv_events.enabled:
                    # KV events name whole nodes: split so the drawn pages form a node of their own
                    self._split_node(node.key, node, keep)  # node keeps the tail, a new parent the rest
                    evicted += self._rlt_delete_leaf(node)
                else:
                    tails.append(self._rlt_trim_tail(node, keep))
            if tails:
                freed = torch.cat(tails)
                self.token_to_kv_pool_allocator.free_segment(freed, start_pos=0)
                evicted += int(freed.numel())
            return evicted

        def _rlt_trim_tail(self, node: Any, keep: int) -> Any:
            """Cut a leaf after its first ``keep`` tokens (a page multiple), in place; returns the slots
            cut. The leaf stays a leaf with the same parent and child key (its first page is kept)."""
            value = node.value
            tail = value[keep:]
            node.value = value[:keep]
            cut_key_tail(node, keep, self.page_size)
            self.evictable_size_ -= tail.shape[0]
            return tail

        def _rlt_delete_leaf(self, node: Any) -> int:
            # the same three steps as SGLang's own RadixCache.evict applies to its victim
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            n = len(node.value)
            self._delete_leaf(node)
            self.kv_events.record_remove(node)
            return n

    RLTRadixCache.__name__ = RLTRadixCache.__qualname__ = f"RLT{cls.__name__}"
    RLTRadixCache.__module__ = __name__
    return RLTRadixCache


def rlt_class_for(cls: type) -> type:
    """``RLT<cls>``: ``cls`` with RLT mixed in front (one class per SGLang class)."""
    rlt_cls = _RLT_CLASSES.get(cls)
    if rlt_cls is None:
        if not issubclass(cls, RadixCache):
            raise TypeError(f"{cls.__name__} is not a RadixCache")
        rlt_cls = _make_rlt_class(cls)
        _RLT_CLASSES[cls] = rlt_cls
    return rlt_cls


def around_radix_cache_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook on ``RadixCache.__init__``: an ``rlt`` tree becomes ``RLT<class>``."""
    from kvroute.engine_patches.sglang.strategy import POLICY_NAME, install_factory_entry

    install_factory_entry()
    original(self, *args, **kwargs)
    if getattr(self, "eviction_policy", None) != POLICY_NAME or self.disable:
        return
    if getattr(self, "kvroute_rlt", False):
        return
    self.__class__ = rlt_class_for(type(self))
    self._rlt_setup()
