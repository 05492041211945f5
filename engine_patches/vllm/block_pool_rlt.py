"""RLT inside vLLM V1's prefix-cache block pool (``vllm.v1.core.block_pool.BlockPool``).

Stock vLLM reuses the block at the head of its free queue: never-cached blocks first, then cached
blocks in LRU order. With RLT installed, when the head is a cached block (a reuse means an eviction),
the block reused is instead a uniformly random *unmarked leaf* cached block; only when no leaf
candidate exists at all does it fall back to vLLM's own LRU head. The bookkeeping (marks, phases,
candidates, chain child counts, free holders) and the per-block loops are C code:
``kvroute.cython_ext.leaf_marking``; this module only wires them into vLLM's methods.

How it stays inside vLLM's own code (nothing of vLLM is copied here):
- ``get_new_blocks``: one C call (``take_victims``) draws the victims, forgetting each at once so its
  parent may be the next leaf, and moves them to the head of vLLM's free queue through the queue's own
  ``remove``/``prepend_n``; then vLLM's ``get_new_blocks`` pops exactly them and evicts them
  (``_maybe_evict_cached_block``: KV events, metrics collector), with ref counts, reuse watchers and
  metrics as always.
- ``cache_full_blocks`` (after vLLM's): mark newly cached blocks, record each one's chain parent
  (a parent key getting its first cached child stops being a leaf).
- ``touch`` (before vLLM's): a hit marks the blocks; blocks leaving the free queue stop being candidates.
- ``free_blocks`` / ``unpin_blocks`` (after vLLM's): blocks whose ref count dropped to 0 become free
  holders of their hash, and candidates when they are cached leaves.
- ``_remove_cached_block_hashes`` (the one place this vLLM drops a block's hashes, reached from
  ``_maybe_evict_cached_block``, ``evict_blocks`` and hash replacement): forget the block; its parent
  may become a leaf. ``move_block_hashes`` carries the chain parent over; ``reset_prefix_cache`` resets.

Installed on the class, so every pool of the process is affected; ``uninstall`` restores vLLM's methods.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvroute.cython_ext.leaf_marking import (
    NO_PARENT,
    UNREGISTERED,
    LeafMarking,
    maybe_free_cached,
    on_cached,
    on_free,
    on_touch,
    take_victims,
)

SEED_ENV = "KVROUTE_RLT_SEED"
PATCHED_METHODS = (
    "__init__",
    "get_new_blocks",
    "cache_full_blocks",
    "touch",
    "free_blocks",
    "unpin_blocks",
    "_remove_cached_block_hashes",
    "move_block_hashes",
    "reset_prefix_cache",
)
# Methods RLT relies on without wrapping them.
REQUIRED_METHODS = ("_maybe_evict_cached_block", "get_num_free_blocks")
_originals: dict[str, Callable[..., Any]] = {}
_vllm: dict[str, Callable[..., Any]] = {}  # vLLM helpers, imported by install()


def _seed_from_env() -> int | None:
    raw = os.environ.get(SEED_ENV)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer, got {raw!r}") from None


def rlt_state(pool: Any) -> LeafMarking:
    """The RLT bookkeeping of a block pool (made on first use for pools built before install)."""
    try:
        return pool._kvroute_rlt
    except AttributeError:
        pass
    # Capacity: every block but vLLM's null block can hold cached content.
    state = LeafMarking(pool.num_gpu_blocks, max(1, pool.num_gpu_blocks - 1), _seed_from_env())
    if pool.enable_caching:
        # Blocks cached before RLT was installed have unknown chain parents: they count as chain
        # roots (leaves); the free ones become candidates.
        for block in pool.blocks:
            if block.block_hash is not None and not block.is_null:
                state.register_cached(block.block_id, None)
                maybe_free_cached(state, pool, block)
    pool._kvroute_rlt = state
    return state


# ---- the wrappers (self is a vllm BlockPool) --------------------------------------------------------


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _originals["__init__"](self, *args, **kwargs)
    rlt_state(self)


def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
    if not self.enable_caching or num_blocks <= 0 or num_blocks > self.get_num_free_blocks():
        return _originals["get_new_blocks"](self, num_blocks)  # vLLM's own path (and its error)
    # One C call chooses the blocks (RLT victims where vLLM would evict its LRU head) and moves them to
    # the head of vLLM's free queue; vLLM's own get_new_blocks below pops exactly them and evicts them:
    # KV events, metrics collector, reuse watchers and ref counts as always.
    take_victims(rlt_state(self), self, num_blocks)
    if self._reuse_watchers:  # watcher callbacks may reach other blocks: keep the bookkeeping wrapper
        return _originals["get_new_blocks"](self, num_blocks)
    # Every block vLLM evicts in there was forgotten above, so its evictions skip the bookkeeping
    # wrapper: vLLM's own _remove_cached_block_hashes shadows it on the instance for this call.
    self._remove_cached_block_hashes = _originals["_remove_cached_block_hashes"].__get__(self)
    try:
        return _originals["get_new_blocks"](self, num_blocks)
    finally:
        del self._remove_cached_block_hashes


def cache_full_blocks(
    self: Any,
    request: Any,
    blocks: list[Any],
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    kv_cache_group_id: int,
    *args: Any,
    **kwargs: Any,
) -> None:
    _originals["cache_full_blocks"](
        self,
        request,
        blocks,
        num_cached_blocks,
        num_full_blocks,
        block_size,
        kv_cache_group_id,
        *args,
        **kwargs,
    )
    if num_cached_blocks >= num_full_blocks:
        return
    block_mask = kwargs.get("block_mask", args[0] if args else None)
    hashes = _vllm["resolve_block_hashes"](request.block_hashes, self.hash_block_size, block_size)
    # vLLM slices blocks[num_cached_blocks:num_full_blocks]: the list may be shorter than num_full_blocks
    stop = min(num_full_blocks, len(blocks), len(hashes))
    on_cached(
        rlt_state(self),
        blocks if type(blocks) is list else list(blocks),
        hashes,
        num_cached_blocks,
        stop,
        _vllm["make_block_hash_with_group_id"],
        kv_cache_group_id,
        block_mask,
    )


def touch(self: Any, blocks: Sequence[Any]) -> None:
    on_touch(rlt_state(self), blocks)  # hits mark; free blocks leave the candidates (and vLLM's queue)
    _originals["touch"](self, blocks)


def free_blocks(self: Any, ordered_blocks: Iterable[Any]) -> None:
    blocks = list(ordered_blocks)  # may be a one-shot iterator (reversed(...))
    _originals["free_blocks"](self, blocks)
    if self.enable_caching:
        on_free(rlt_state(self), self, blocks)


def unpin_blocks(self: Any, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
    blocks = list(blocks)
    _originals["unpin_blocks"](self, blocks, on_reuse)
    if self.enable_caching:
        on_free(rlt_state(self), self, blocks)


def _remove_cached_block_hashes(self: Any, block: Any) -> list[Any]:
    if block.block_hash is None:  # nothing cached here (vLLM still clears any stray entries)
        return _originals["_remove_cached_block_hashes"](self, block)
    removed = _originals["_remove_cached_block_hashes"](self, block)
    # get_new_blocks forgets its victims beforehand; forgetting twice changes nothing. A parent key left
    # without cached children makes its free holders candidates.
    rlt_state(self).forget_cached(block.block_id)
    return removed


def move_block_hashes(self: Any, src_block: Any, dst_block: Any) -> None:
    state = rlt_state(self)
    parent_key = state.parent_of(src_block.block_id)
    was_marked = state.is_marked(src_block.block_id)
    _originals["move_block_hashes"](self, src_block, dst_block)
    if dst_block.block_hash is None:
        return
    if parent_key is not UNREGISTERED:
        parent_key = None if parent_key is NO_PARENT else parent_key
        state.register_cached(dst_block.block_id, parent_key)
    if was_marked:
        state.mark(dst_block.block_id)
    maybe_free_cached(state, self, dst_block)


def reset_prefix_cache(self: Any) -> bool:
    ok = _originals["reset_prefix_cache"](self)
    if ok:
        rlt_state(self).reset()
    return ok


_WRAPPERS: dict[str, Callable[..., Any]] = {
    "__init__": _init,
    "get_new_blocks": get_new_blocks,
    "cache_full_blocks": cache_full_blocks,
    "touch": touch,
    "free_blocks": free_blocks,
    "unpin_blocks": unpin_blocks,
    "_remove_cached_block_hashes": _remove_cached_block_hashes,
    "move_block_hashes": move_block_hashes,
    "reset_prefix_cache": reset_prefix_cache,
}


def is_installed() -> bool:
    return bool(_originals)


def install() -> None:
    """Patch ``BlockPool`` with RLT (idempotent). Raises RuntimeError when this vLLM lacks a method."""
    if _originals:
        return
    from vllm.v1.core.block_pool import BlockPool

    missing = [name for name in (*PATCHED_METHODS, *REQUIRED_METHODS) if not hasattr(BlockPool, name)]
    if missing:
        raise RuntimeError(
            f"kvroute RLT: this vLLM's BlockPool lacks {missing}; the patch supports vLLM 0.32.x"
        )
    _seed_from_env()  # a bad seed fails here, at startup, not at the first allocation
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes

    _vllm["make_block_hash_with_group_id"] = make_block_hash_with_group_id
    _vllm["resolve_block_hashes"] = resolve_block_hashes
    for name in PATCHED_METHODS:
        original = BlockPool.__dict__[name]
        _originals[name] = original
        wrapper = functools.wraps(original)(_WRAPPERS[name])
        setattr(BlockPool, name, wrapper)
    # A child of vLLM's logger, so it shows in the server log of the process that loaded the plugin.
    logging.getLogger("vllm.kvroute").info(
        "kvroute: RLT eviction installed in vLLM's BlockPool (pid %d)", os.getpid()
    )


def uninstall() -> None:
    """Restore vLLM's own methods (pools keep their RLT state attribute, now unused)."""
    if not _originals:
        return
    from vllm.v1.core.block_pool import BlockPool

    for name, original in _originals.items():
        setattr(BlockPool, name, original)
    _originals.clear()
