"""Property tests: random insert / match / lock / unlock / evict sequences for every policy."""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.cache import LruPyCache, RadixCache

# CI keeps the example count modest; KVROUTE_HYPOTHESIS_EXAMPLES=2000 for a deeper local search
EXAMPLES = int(os.environ.get("KVROUTE_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=14)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens_st),
        st.tuples(st.just("match"), tokens_st),
        st.tuples(st.just("lock"), tokens_st),
        st.tuples(st.just("unlock"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(0, 25)),
    ),
    min_size=1,
    max_size=60,
)


def _sizes_from_tree(cache) -> None:
    if isinstance(cache, RadixCache):
        cache._debug_check()
    else:  # lru-py: recompute sizes by walking the tree
        ev = pr = 0
        stack = list(cache.root.children.values())
        while stack:
            n = stack.pop()
            if n.lock_ref:
                pr += len(n.key)
            else:
                ev += len(n.key)
            stack.extend(n.children.values())
        assert (ev, pr) == (cache.evictable_size, cache.protected_size)
    assert cache.total_size == cache.evictable_size + cache.protected_size <= cache.capacity_tokens


def _run_ops(cache, ops, page: int) -> None:
    held: list[tuple[object, list[int], int]] = []  # (node, tokens, hit length when locked)
    for op, arg in ops:
        if op == "insert":
            aligned = len(arg) // page * page
            before = cache._peek(arg)
            stored = cache.insert(arg)
            after = cache._peek(arg)
            # a prefix just inserted matches, unless the cache ran out of room for the rest
            assert after == before + stored
            assert after == aligned or cache.capacity_tokens - cache.total_size < page
        elif op == "match":
            hit, _ = cache.match_prefix(arg)
            assert hit % page == 0 and hit <= len(arg)
        elif op == "lock":
            hit, node = cache.match_prefix(arg)
            cache.lock(node)
            held.append((node, arg, hit))
        elif op == "unlock" and held:
            node, _, _ = held.pop(arg % len(held))
            cache.unlock(node)
        elif op == "evict":
            locked_before = cache.protected_size
            freed = cache.evict(arg)
            assert freed >= 0
            assert cache.protected_size == locked_before
        _sizes_from_tree(cache)
        for _, tokens, hit in held:  # locked tokens are never evicted
            assert cache._peek(tokens) >= hit
    for node, _, _ in held:
        cache.unlock(node)
    assert cache.protected_size == 0
    _sizes_from_tree(cache)


@SETTINGS
@given(
    policy=st.sampled_from(["lru", "rlt", "rlt-leaf", "lru-py"]),
    capacity=st.integers(0, 40),
    page=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**32),
    ops=ops_st,
)
def test_online_policies_keep_invariants(policy: str, capacity: int, page: int, seed: int, ops) -> None:
    if policy == "lru-py":
        cache = LruPyCache(capacity, page_size=page)
    else:
        cache = RadixCache(capacity, page_size=page, policy=policy, seed=seed)
    _run_ops(cache, ops, page)


@SETTINGS
@given(
    capacity=st.integers(1, 40),
    page=st.sampled_from([1, 2]),
    trace=st.lists(tokens_st, min_size=1, max_size=25),
    probes=st.lists(st.tuples(tokens_st, st.booleans(), st.integers(0, 12)), max_size=25),
)
def test_opt_keeps_invariants(capacity: int, page: int, trace, probes) -> None:
    """opt: matches, locks and evictions interleaved with the trace's inserts."""
    cache = RadixCache.with_future(capacity, trace, page_size=page)
    held = []
    for i, seq in enumerate(trace):
        probe, lock, k = probes[i] if i < len(probes) else ([], False, 0)
        hit, node = cache.match_prefix(probe)
        if lock:
            cache.lock(node)
            held.append((node, probe, hit))
        cache.evict(k)
        before = cache._peek(seq)
        stored = cache.insert(seq)
        assert cache._peek(seq) == before + stored
        cache._debug_check()
        for _, tokens, h in held:
            assert cache._peek(tokens) >= h
    for node, _, _ in held:
        cache.unlock(node)
    cache._debug_check()


def _marked_leaves(cache: RadixCache) -> tuple[dict[int, tuple[int, bool]], bool]:
    """{node_id: (length, marked)} of unlocked leaves, and whether an unmarked one exists."""
    leaves = {
        nid: (length, marked) for nid, _, length, lock, leaf, marked in cache._nodes() if leaf and not lock
    }
    return leaves, any(not marked for _, marked in leaves.values())


@SETTINGS
@given(
    capacity=st.integers(4, 60),
    page=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32),
    ops=ops_st,
)
def test_rlt_never_evicts_a_marked_token_while_an_unmarked_candidate_exists(
    capacity, page, seed, ops
) -> None:
    cache = RadixCache(capacity, page_size=page, policy="rlt", seed=seed)
    held = []
    for op, arg in ops:
        if op in ("insert", "match"):
            (cache.insert if op == "insert" else cache.match_prefix)(arg)
        elif op == "lock":
            _, node = cache.match_prefix(arg)
            cache.lock(node)
            held.append(node)
        elif op == "unlock" and held:
            cache.unlock(held.pop(arg % len(held)))
        elif op == "evict" and arg % 2:  # one bulk eviction (block draws)
            leaves, _ = _marked_leaves(cache)
            phases = cache.phases
            cache.evict(arg * page)
            if cache.phases == phases:  # no phase turned over: every marked leaf is intact
                after = {nid: length for nid, _, length, lock, leaf, _ in cache._nodes() if leaf and not lock}
                for nid, (length, marked) in leaves.items():
                    if marked:
                        assert after.get(nid) == length
        elif op == "evict":
            for _ in range(arg):  # one page at a time, checking each draw
                leaves, unmarked_exists = _marked_leaves(cache)
                phases = cache.phases
                if cache.evict(1) == 0:
                    assert not leaves
                    break
                after = {nid: length for nid, _, length, lock, leaf, _ in cache._nodes() if leaf and not lock}
                changed = [nid for nid, (length, _) in leaves.items() if after.get(nid) != length]
                assert len(changed) == 1  # exactly one leaf lost exactly one page
                nid = changed[0]
                assert after.get(nid, 0) == leaves[nid][0] - page
                if unmarked_exists:
                    assert not leaves[nid][1], "evicted a marked token while an unmarked candidate existed"
                    assert cache.phases == phases
                else:
                    assert cache.phases == phases + 1
        cache._debug_check()


@SETTINGS
@given(
    capacity=st.integers(4, 60),
    page=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32),
    ops=ops_st,
)
def test_rlt_leaf_draws_whole_unmarked_leaves(capacity, page, seed, ops) -> None:
    """rlt-leaf: a draw takes one whole unlocked leaf, unmarked unless no unmarked one is left (then a
    new phase starts); a bulk evict frees at least what was asked when that much is evictable, and
    leaves marked leaves intact unless a phase turned over."""
    cache = RadixCache(capacity, page_size=page, policy="rlt-leaf", seed=seed)
    held = []
    for op, arg in ops:
        if op in ("insert", "match"):
            (cache.insert if op == "insert" else cache.match_prefix)(arg)
        elif op == "lock":
            _, node = cache.match_prefix(arg)
            cache.lock(node)
            held.append(node)
        elif op == "unlock" and held:
            cache.unlock(held.pop(arg % len(held)))
        elif op == "evict" and arg % 2:  # one bulk eviction
            leaves, _ = _marked_leaves(cache)
            phases, evictable = cache.phases, cache.evictable_size
            freed = cache.evict(arg)
            assert freed >= min(arg, evictable) and cache.evictable_size == evictable - freed
            after = {nid: length for nid, _, length, lock, leaf, _ in cache._nodes() if leaf and not lock}
            for nid, (length, marked) in leaves.items():
                assert after.get(nid, length) == length  # a leaf goes whole or stays whole
                if marked and cache.phases == phases:
                    assert nid in after
        elif op == "evict":
            leaves, unmarked_exists = _marked_leaves(cache)
            phases = cache.phases
            freed = cache.evict(1)
            if freed == 0:
                assert not leaves
                continue
            after = {nid: length for nid, _, length, lock, leaf, _ in cache._nodes() if leaf and not lock}
            gone = [nid for nid in leaves if nid not in after]
            assert len(gone) == 1 and freed == leaves[gone[0]][0]  # exactly one leaf, whole
            assert all(after[nid] == length for nid, (length, _) in leaves.items() if nid in after)
            if unmarked_exists:
                assert not leaves[gone[0]][1], "drew a marked leaf while an unmarked candidate existed"
                assert cache.phases == phases
            else:
                assert cache.phases == phases + 1
        cache._debug_check()


@settings(max_examples=max(40, EXAMPLES * 2 // 3), deadline=None)
@given(
    capacity=st.integers(4, 30),
    page=st.sampled_from([1, 2]),
    trace=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=40),
)
def test_opt_never_scores_fewer_hits_than_lru_or_rlt(capacity: int, page: int, trace) -> None:
    trace = [seq[: capacity // page * page] for seq in trace]  # a request fits in the cache

    def hits(cache) -> int:
        total = 0
        for seq in trace:
            total += cache.match_prefix(seq)[0]
            cache.insert(seq)
        return total

    best = hits(RadixCache.with_future(capacity, trace, page_size=page))
    assert best >= hits(RadixCache(capacity, page_size=page, policy="lru"))
    assert best >= hits(LruPyCache(capacity, page_size=page))
    for seed in range(3):
        assert best >= hits(RadixCache(capacity, page_size=page, policy="rlt", seed=seed))
        assert best >= hits(RadixCache(capacity, page_size=page, policy="rlt-leaf", seed=seed))


def test_opt_beats_online_policies_on_a_structured_trace() -> None:
    """Larger deterministic trace with shared prefixes (many phases, splits and partial leaves)."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
    trace = [
        rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(600)
    ]
    results = {}
    for name in ("opt", "lru", "rlt", "rlt-leaf"):
        cache = RadixCache.with_future(300, trace) if name == "opt" else RadixCache(300, policy=name, seed=0)
        total = 0
        for seq in trace:
            total += cache.match_prefix(seq)[0]
            cache.insert(seq)
        cache._debug_check()
        results[name] = total
    assert results["opt"] >= max(results["lru"], results["rlt"], results["rlt-leaf"])
    assert results["opt"] > 0
