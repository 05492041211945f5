"""RLT inside the installed vLLM's BlockPool, driven through vLLM's own KVCacheManager.

Checked here: the plugin entry point (unset/lru leave vLLM untouched), vLLM's ref-count and free-queue
invariants under random concurrent requests, leaf-only eviction (seen through vLLM's own KV events), KV
events and metrics still produced, the RLT candidate set exactly the free cached leaves, and the hit rate
on a worst-case round-robin trace.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BLOCK = 4
PATCHED = (
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


def _block_pool_methods() -> dict[str, Any]:
    from vllm.v1.core.block_pool import BlockPool

    return {name: BlockPool.__dict__[name] for name in PATCHED}


class Engine:
    """vLLM's scheduler-side cache path, request by request (admit -> run -> finish), like its scheduler."""

    def __init__(self, num_blocks: int, *, events: bool = True, metrics_rate: float = 0.0) -> None:
        from kvroute.bench.engine_evict_vllm import _vllm_imports, make_manager

        v = _vllm_imports()
        self.mgr = make_manager(
            num_blocks, BLOCK, enable_kv_cache_events=events, metrics_sample_rate=metrics_rate
        )
        self.pool = self.mgr.block_pool
        self._request_cls, self._params = v.Request, v.SamplingParams(max_tokens=1)
        self._hasher = v.get_request_block_hasher(BLOCK, v.sha256)
        self.running: dict[str, Any] = {}
        self.hit_tokens = 0
        self.n = 0

    def admit(self, tokens: list[int]) -> str | None:
        """Look up, allocate and 'compute' a request's prompt; None when the pool cannot hold it now."""
        self.n += 1
        req = self._request_cls(f"q{self.n}", tokens, self._params, None, block_hasher=self._hasher)
        blocks, n_hit, _ = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, len(tokens) - n_hit, n_hit, blocks) is None:
            return None
        self.mgr.record_prefix_cache_stats(req, n_hit)
        self.hit_tokens += n_hit
        req.num_computed_tokens = len(tokens)
        self.running[req.request_id] = req
        return req.request_id

    def finish(self, request_id: str) -> None:
        self.mgr.free(self.running.pop(request_id))

    def serve(self, tokens: list[int]) -> None:
        rid = self.admit(tokens)
        assert rid is not None, "pool too small for one request"
        self.finish(rid)

    def req_blocks(self, request_id: str) -> list[Any]:
        return self.mgr.coordinator.single_type_managers[0].req_to_blocks[request_id]


def check_vllm_invariants(eng: Engine) -> None:
    """vLLM's own invariants: free queue consistent, ref counts = holders, cache map consistent."""
    pool = eng.pool
    queue = pool.free_block_queue
    free = queue.get_all_free_blocks()
    assert len(free) == queue.num_free_blocks
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free)
    holders: Counter[int] = Counter()
    for rid in eng.running:
        for blk in eng.req_blocks(rid):
            if not blk.is_null:
                holders[blk.block_id] += 1
    for blk in pool.blocks:
        if blk.is_null:
            assert blk.block_id not in free_ids
            continue
        assert blk.ref_cnt == holders[blk.block_id], blk
        assert (blk.ref_cnt == 0) == (blk.block_id in free_ids), blk
        if blk.block_hash is not None:
            assert pool.cached_block_hash_to_block.contain(blk.block_hash, blk.block_id)


def check_rlt_candidates(eng: Engine, parent_of: dict[bytes, bytes | None]) -> None:
    """RLT's candidates are exactly the free cached blocks that no cached block continues."""
    from kvroute.engine_patches.vllm.block_pool_rlt import rlt_state

    state = rlt_state(eng.pool)
    state.check_invariants()
    cached = {b.block_hash for b in eng.pool.blocks if b.block_hash is not None}
    with_child = {parent_of[k] for k in cached if parent_of.get(k) is not None}
    expected = {
        b.block_id
        for b in eng.pool.blocks
        if b.block_hash is not None and b.ref_cnt == 0 and b.block_hash not in with_child
    }
    assert set(state.slots) == expected


def record_chain(eng: Engine, tokens: list[int], parent_of: dict[bytes, bytes | None]) -> None:
    """The test's own view of the hash chain (from vLLM's block hasher), independent of the patch."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = eng._request_cls("probe", tokens, eng._params, None, block_hasher=eng._hasher)
    prev = None
    for h in req.block_hashes:
        key = make_block_hash_with_group_id(h, 0)
        parent_of[key] = prev
        prev = key


# ---- the plugin entry point ----------------------------------------------------------------------


def test_unset_or_lru_leaves_vllm_untouched(stock: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.engine_patches.vllm import register

    before = _block_pool_methods()
    for value in (None, "", "lru", "LRU"):
        if value is None:
            monkeypatch.delenv("KVROUTE_EVICTION", raising=False)
        else:
            monkeypatch.setenv("KVROUTE_EVICTION", value)
        register()
        assert _block_pool_methods() == before


def test_rlt_through_vllms_plugin_loader_is_idempotent(stock: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import entry_points

    import vllm.plugins
    from kvroute.engine_patches.vllm import block_pool_rlt, register

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvroute") == "kvroute.engine_patches.vllm:register"
    stock_methods = _block_pool_methods()
    monkeypatch.setenv("KVROUTE_EVICTION", "rlt")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        vllm.plugins.load_general_plugins()  # how every vLLM process loads it
        patched = _block_pool_methods()
        assert all(patched[name] is not stock_methods[name] for name in PATCHED)
        register()  # loaded again (another process start path): no double wrapping
        assert _block_pool_methods() == patched
    finally:
        block_pool_rlt.uninstall()
    assert _block_pool_methods() == stock_methods


def test_bad_policy_or_seed_is_a_clear_error(stock: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.engine_patches.vllm import block_pool_rlt, register

    monkeypatch.setenv("KVROUTE_EVICTION", "fifo")
    with pytest.raises(ValueError, match="KVROUTE_EVICTION"):
        register()
    monkeypatch.setenv("KVROUTE_EVICTION", "rlt")
    monkeypatch.setenv("KVROUTE_RLT_SEED", "abc")
    with pytest.raises(ValueError, match="KVROUTE_RLT_SEED"):
        register()
    assert not block_pool_rlt.is_installed()


# ---- behaviour inside vLLM's block pool ------------------------------------------------------------


# The rlt fixture only installs the class patch; each example builds its own pool (fresh state).
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    n_prefixes=st.integers(1, 5),
    steps=st.lists(st.integers(0, 99), min_size=5, max_size=60),
)
def test_random_concurrent_requests_keep_vllm_and_rlt_invariants(
    rlt: None, seed: int, n_prefixes: int, steps: list[int]
) -> None:
    rng = random.Random(seed)
    eng = Engine(num_blocks=24)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(0, 4 * BLOCK))] for _ in range(n_prefixes)]
    parent_of: dict[bytes, bytes | None] = {}
    for step in steps:
        if eng.running and (step % 3 == 0 or len(eng.running) >= 3):
            eng.finish(rng.choice(sorted(eng.running)))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(1 + step % (3 * BLOCK))]
            record_chain(eng, tokens, parent_of)
            eng.admit(tokens)
        check_vllm_invariants(eng)
        check_rlt_candidates(eng, parent_of)
    for rid in sorted(eng.running):
        eng.finish(rid)
    check_vllm_invariants(eng)
    check_rlt_candidates(eng, parent_of)
    assert eng.pool.get_num_free_blocks() == 23  # all but the null block


def _round_robin(groups: int, prefix_blocks: int, turns: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_blocks * BLOCK)] for _ in range(groups)]
    return [
        prefixes[g] + [rng.randrange(32000) for _ in range(BLOCK + 1)]
        for _ in range(turns)
        for g in range(groups)
    ]


def test_evictions_are_leaves_and_kv_events_tell_them(rlt: None) -> None:
    """Replay vLLM's BlockStored/BlockRemoved events into a chain of our own: every block removed had
    no cached continuation at that moment, and every removal was announced."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    eng = Engine(num_blocks=40, events=True)
    cached: Counter[Any] = Counter()
    children: Counter[Any] = Counter()
    parent: dict[Any, Any] = {}
    removed = stored = 0
    for tokens in _round_robin(groups=6, prefix_blocks=6, turns=5):
        eng.serve(tokens)
        for event in eng.pool.take_events():
            if isinstance(event, BlockStored):
                prev = event.parent_block_hash
                for h in event.block_hashes:
                    stored += 1
                    cached[h] += 1
                    parent[h] = prev
                    if prev is not None:
                        children[prev] += 1
                    prev = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    removed += 1
                    assert cached[h] > 0, "removal of a block never stored"
                    assert cached[h] > 1 or children[h] == 0, "an inner block was evicted"
                    cached[h] -= 1
                    if parent[h] is not None:
                        children[parent[h]] -= 1
    assert stored > 0 and removed > 0
    live = sum(1 for b in eng.pool.blocks if b.block_hash is not None)
    assert stored - removed == live


@pytest.mark.parametrize("seed", range(5))
def test_marked_blocks_outlive_unmarked_ones(rlt: None, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks hit in the current phase are marked: while unmarked leaves exist, they are not evicted."""
    from kvroute.engine_patches.vllm.block_pool_rlt import rlt_state
    from vllm.distributed.kv_events import BlockRemoved

    monkeypatch.setenv("KVROUTE_RLT_SEED", str(seed))
    eng = Engine(num_blocks=9, events=True)  # 8 usable blocks
    a, b, c = ([k] * (2 * BLOCK) for k in (1, 2, 3))  # 2-block prefixes
    for tokens in (a + [9], b + [9], c + [9]):  # 6 cached blocks, 2 free
        eng.serve(tokens)
    a_blocks = {blk.block_id for blk in eng.pool.blocks if blk.block_hash is not None}
    state = rlt_state(eng.pool)
    state.start_phase()  # a fresh phase: nothing marked
    eng.serve(a + [8])  # hits a's blocks: they are marked again
    a_blocks = {bid for bid in a_blocks if state.is_marked(bid)}
    assert len(a_blocks) == 2
    eng.pool.take_events()
    for k in range(4):  # each caches one new (marked) block: needs evictions of b's and c's blocks
        eng.serve([100 + k] * (BLOCK + 1))
    removed = sum(len(e.block_hashes) for e in eng.pool.take_events() if isinstance(e, BlockRemoved))
    assert removed >= 3
    assert all(eng.pool.blocks[bid].block_hash is not None for bid in a_blocks)
    hit_before = eng.hit_tokens
    eng.serve(a + [7])
    assert eng.hit_tokens - hit_before == 2 * BLOCK  # a's prefix survived


def test_metrics_and_prefix_stats_still_counted(rlt: None) -> None:
    """vLLM's KVCacheMetricsCollector sees every reuse of a block, and PrefixCacheStats every hit."""
    eng = Engine(num_blocks=30, events=False, metrics_rate=1.0)  # sample every block
    allocations: Counter[int] = Counter()
    inner = eng.pool.get_new_blocks

    def counting(n: int) -> list[Any]:
        out = inner(n)
        allocations.update(b.block_id for b in out)
        return out

    eng.pool.get_new_blocks = counting
    trace = _round_robin(groups=5, prefix_blocks=5, turns=4)
    for tokens in trace:
        eng.serve(tokens)
    collector = eng.pool.metrics_collector
    evictions = collector.drain_events()
    reuses = sum(n - 1 for n in allocations.values())  # each allocation after a block's first one
    assert len(evictions) == reuses > 0
    stats = eng.mgr.make_prefix_cache_stats()
    assert stats.requests == len(trace)
    assert stats.queries == sum(len(t) for t in trace)
    assert stats.hits == eng.hit_tokens > 0


def test_reset_prefix_cache_clears_rlt_state(rlt: None) -> None:
    from kvroute.engine_patches.vllm.block_pool_rlt import rlt_state

    eng = Engine(num_blocks=20)
    for tokens in _round_robin(groups=2, prefix_blocks=2, turns=2):
        eng.serve(tokens)
    state = rlt_state(eng.pool)
    assert state.num_candidates > 0 and state.children
    assert eng.pool.reset_prefix_cache()
    assert state.num_candidates == 0 and not state.children and state.marked_count == 0
    state.check_invariants()
    eng.serve(_round_robin(groups=1, prefix_blocks=2, turns=1)[0])  # and it keeps working
    check_vllm_invariants(eng)


def _hit_rate(policy: str, trace: list[list[int]], num_blocks: int, seed: int) -> float:
    import os

    from kvroute.engine_patches.vllm import block_pool_rlt

    os.environ["KVROUTE_RLT_SEED"] = str(seed)
    (block_pool_rlt.install if policy == "rlt" else block_pool_rlt.uninstall)()
    try:
        eng = Engine(num_blocks=num_blocks, events=False)
        for tokens in trace:
            eng.serve(tokens)
        stats = eng.mgr.make_prefix_cache_stats()
        return stats.hits / stats.queries
    finally:
        block_pool_rlt.uninstall()
        os.environ.pop("KVROUTE_RLT_SEED", None)


def test_worst_case_round_robin_hit_rate_rlt_beats_vllm_lru(vllm_available: None) -> None:
    """8 groups x 8-block prefixes cycled through 56 blocks: vLLM's LRU always evicts the prefix needed
    next (0 hits); RLT keeps a random part of them."""
    trace = _round_robin(groups=8, prefix_blocks=8, turns=6)
    lru = _hit_rate("lru", trace, num_blocks=57, seed=0)
    rlt = [_hit_rate("rlt", trace, num_blocks=57, seed=s) for s in range(3)]
    assert lru < 0.02
    assert min(rlt) > lru + 0.05, (lru, rlt)


def test_cache_full_blocks_with_fewer_blocks_than_full_blocks(rlt: None) -> None:
    """vLLM slices ``blocks[num_cached:num_full]``, so a shorter list is legal; RLT's bookkeeping follows."""
    from kvroute.engine_patches.vllm.block_pool_rlt import rlt_state

    eng = Engine(num_blocks=10, events=False)
    req = eng._request_cls("short", list(range(3 * BLOCK + 1)), eng._params, None, block_hasher=eng._hasher)
    blocks = eng.pool.get_new_blocks(2)
    eng.pool.cache_full_blocks(req, blocks, 0, 3, BLOCK, 0)
    assert all(b.block_hash is not None for b in blocks)
    state = rlt_state(eng.pool)
    assert state.parent_of(blocks[1].block_id) == blocks[0].block_hash  # chained
    assert not state.is_leaf_key(blocks[0].block_hash) and state.is_leaf_key(blocks[1].block_hash)
    eng.pool.free_blocks(reversed(blocks))
    assert set(state.slots) == {blocks[1].block_id}  # only the leaf is drawable
    state.check_invariants()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), n_blocks=st.integers(2, 40), data=st.data())
def test_take_victims_chooses_as_one_at_a_time_moves_would(
    vllm_available: None, seed: int, n_blocks: int, data: st.DataObject
) -> None:
    """``take_victims`` chooses ahead of moving (a prefetch pipeline). Against a plain model that moves
    each block as soon as it is chosen, on vLLM's own free queue with cached and never-cached blocks
    mixed in any order: the same blocks in the same order, and the queue then starts with them."""
    from types import SimpleNamespace

    from kvroute.cython_ext.leaf_marking import LeafMarking, take_victims
    from leaf_marking_reference import ReferenceLeafMarking
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    rng = random.Random(seed)
    blocks = [KVCacheBlock(i) for i in range(n_blocks)]
    queue = FreeKVCacheBlockQueue(blocks)
    order = list(range(n_blocks))
    rng.shuffle(order)
    for b in blocks:
        queue.remove(b)
    for i in order:
        queue.append(blocks[i])
    state = LeafMarking(n_blocks, capacity=max(1, n_blocks - 1), seed=seed)
    ref = ReferenceLeafMarking(n_blocks, capacity=max(1, n_blocks - 1), seed=seed)
    keys = [f"key{rng.randrange(n_blocks)}".encode() for _ in range(n_blocks)]  # duplicates happen
    for b in range(n_blocks):
        if rng.random() < 0.75:  # cached (and free); the rest never cached
            blocks[b].set_block_hash(keys[b])
            parent = rng.choice([None, *keys])
            for s in (state, ref):
                s.register_cached(b, parent)
                s.add_free_cached(b, keys[b])
    for b in rng.sample(range(n_blocks), k=n_blocks // 3):  # some marks: draws skip them
        state.mark(b)
        ref.mark(b)
    k = data.draw(st.integers(1, n_blocks))
    pool = SimpleNamespace(free_block_queue=queue, blocks=blocks)
    got = [b.block_id for b in take_victims(state, pool, k)]

    model_queue, expected = list(order), []
    for _ in range(k):
        head = model_queue[0]
        if blocks[head].block_hash is not None:
            victim = ref.draw()
            victim = head if victim is None else victim
            ref.forget_cached(victim)
        else:
            victim = head
        model_queue.remove(victim)
        expected.append(victim)
    assert got == expected
    assert [b.block_id for b in queue.get_all_free_blocks()] == expected + model_queue
    assert state.slots == ref.slots
    state.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    steps=st.lists(st.integers(0, 99), min_size=10, max_size=50),
)
def test_unpin_evict_blocks_and_move_keep_the_candidates_exact(
    rlt: None, seed: int, steps: list[int]
) -> None:
    """vLLM's other ways in and out of the prefix cache, mixed with requests: ``unpin_blocks`` (blocks
    readable until reused: reuse watchers), ``evict_blocks`` (a KV connector drops hashes, of free or
    held blocks) and ``move_block_hashes`` (a cache entry moves to a private copy). After each step the
    candidates are exactly the free cached leaves and vLLM's own invariants hold."""
    rng = random.Random(seed)
    eng = Engine(num_blocks=24)
    pool = eng.pool
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(BLOCK, 4 * BLOCK))] for _ in range(3)]
    parent_of: dict[bytes, bytes | None] = {}
    unpinned: set[int] = set()
    reused: list[int] = []
    for step in steps:
        op = step % 5
        if op == 0 and eng.running:  # release a request's blocks through unpin_blocks, not free
            rid = rng.choice(sorted(eng.running))
            blocks = [b for b in eng.req_blocks(rid) if not b.is_null]
            del eng.running[rid]
            pool.unpin_blocks(blocks, lambda b: reused.append(b.block_id))
            unpinned.update(b.block_id for b in blocks)
        elif op == 1:  # a KV connector evicts some blocks' hashes
            pool.evict_blocks({rng.randrange(1, 24) for _ in range(3)})
        elif op == 2 and eng.running and pool.get_num_free_blocks() > 0:  # move a cached entry to a copy
            rid = rng.choice(sorted(eng.running))
            cached = [b for b in eng.req_blocks(rid) if b.block_hash is not None]
            if cached:
                (copy,) = pool.get_new_blocks(1)
                pool.move_block_hashes(cached[-1], copy)
                pool.free_blocks([copy])
        elif op == 3 and eng.running:
            eng.finish(rng.choice(sorted(eng.running)))
        elif len(eng.running) < 3:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(1 + step % (3 * BLOCK))]
            record_chain(eng, tokens, parent_of)
            eng.admit(tokens)
        check_vllm_invariants(eng)
        check_rlt_candidates(eng, parent_of)
    assert set(reused) <= unpinned  # watchers fire for unpinned blocks only, when vLLM reuses them
