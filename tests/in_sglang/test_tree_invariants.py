"""(b) SGLang's installed RadixCache and UnifiedRadixCache, CPU pools, policy rlt: tree invariants under
random operations (hypothesis), page sizes 1 and 4; RLT's victim rule; other policies untouched."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.bench.engine_evict_sglang import TreeDriver, build_cache

POOL = 64
KINDS = ("unified", "radix")


def _evict(cache: Any, n: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted


def _evictable(driver: TreeDriver) -> int:
    cache = driver.cache
    return cache.full_evictable_size() if driver.kind == "unified" else cache.evictable_size()


def _legacy_leaves(cache: Any) -> set:
    leaves, stack = set(), [cache.root_node]
    while stack:
        node = stack.pop()
        live = [c for c in node.children.values() if not c.evicted]
        stack.extend(live)
        if node is not cache.root_node and not live and node.lock_ref == 0 and not node.evicted:
            leaves.add(node)
    return leaves


def check_invariants(driver: TreeDriver) -> None:
    cache, allocator = driver.cache, driver.allocator
    free = allocator.available_size()
    if driver.kind == "unified":
        cache.tree_core.sanity_check([], [])  # SGLang's own checker: structure, leaf sets, sizes
        in_tree = cache.full_evictable_size() + cache.full_protected_size()
        leaves = cache.tree_core.evictable_device_leaves
    else:
        in_tree = cache.evictable_size() + cache.protected_size()
        assert in_tree == cache.total_size()
        leaves = cache.evictable_leaves
        assert set(leaves) == _legacy_leaves(cache)
    assert in_tree + free == POOL, "KV slots leaked or double-freed"
    if getattr(cache, "kvroute_rlt", False):
        leaves.check()  # candidate array == SGLang's leaf set, unmarked run == unmarked leaves
    for seq, _lock in driver.held:  # locked paths are never evicted
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        assert cache.match_prefix(MatchPrefixParams(key=driver._key(seq))).device_prefix_len == len(seq)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.lists(st.integers(0, 3), min_size=1, max_size=40), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 5), st.just(False)),
        st.tuples(st.just("evict"), st.integers(1, 48), st.just(False)),
    ),
    max_size=30,
)


@pytest.mark.parametrize(
    ("policy", "page_size", "kv_events"),
    # KV events on: drawn pages are split off, not cut in place; rlt-leaf: unit="leaf"
    [("rlt", 1, False), ("rlt", 4, False), ("rlt", 4, True), ("rlt-leaf", 1, False), ("rlt-leaf", 4, True)],
)
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_rlt_tree_invariants_under_random_operations(
    sglang_plugin: None, kind: str, policy: str, page_size: int, kv_events: bool, ops: list, seed: int
) -> None:
    cache, allocator = build_cache(
        kind, policy, POOL, page_size, seed=seed, capacity_tokens=POOL, kv_events=kv_events
    )
    assert getattr(cache, "kvroute_rlt", False)
    driver = TreeDriver(cache, allocator, kind)
    for op, a, b in ops:
        if op == "serve":
            if b and len(driver.held) >= 2:
                driver.release(0)
            driver.serve([t + 1 for t in a], hold=b)  # ids 1..4: many shared prefixes and splits
        elif op == "release":
            if driver.held:
                driver.release(a % len(driver.held))
        else:
            evictable = _evictable(driver)
            freed = _evict(cache, a)
            want = -(-a // page_size) * page_size
            if policy == "rlt":
                assert freed == min(want, evictable), "rlt frees exactly the pages asked (token/page exact)"
            else:  # whole leaves: at least what was asked (or everything evictable)
                assert min(a, evictable) <= freed <= evictable
        check_invariants(driver)
    while driver.held:
        driver.release()
    check_invariants(driver)
    freed = _evict(cache, POOL)
    assert freed == _evict_all_expected(driver, freed)
    assert allocator.available_size() == POOL


def _evict_all_expected(driver: TreeDriver, freed: int) -> int:
    assert _evictable(driver) == 0  # with no lock held everything is evictable, and went
    return freed


def _seq(first: int, pages: int, page_size: int) -> list[int]:
    return [first] + [first * 1000 + i for i in range(pages * page_size - 1)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_rlt_evicts_a_random_unmarked_leaf_page_by_page(
    sglang_plugin: None, kind: str, page_size: int
) -> None:
    """k = one request: each access starts a phase in which only its own path is marked. After A, B, C
    are cached and A is read again, RLT must take its pages from B or C (unmarked), never from A; which
    one is random (both get chosen across seeds) and it takes exactly the pages asked for."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    pages = 8
    trimmed = {"B": 0, "C": 0}
    for seed in range(16):
        cache, allocator = build_cache(
            kind, "rlt", 256 * page_size, page_size, seed=seed, capacity_tokens=pages * page_size
        )
        driver = TreeDriver(cache, allocator, kind)
        seqs = {name: _seq(i + 1, pages, page_size) for i, name in enumerate("ABC")}
        for seq in seqs.values():
            driver.serve(seq)
        driver.serve(seqs["A"])  # A is the only marked path now
        assert _evict(cache, 2 * page_size) == 2 * page_size
        hits = {
            name: int(cache.match_prefix(MatchPrefixParams(key=driver._key(seq))).device_prefix_len)
            for name, seq in seqs.items()
        }
        assert hits["A"] == pages * page_size
        assert hits["B"] + hits["C"] == 2 * pages * page_size - 2 * page_size
        for name in "BC":
            trimmed[name] += hits[name] < pages * page_size
        check_invariants_pool(driver, 256 * page_size)
    assert trimmed["B"] > 0 and trimmed["C"] > 0, trimmed


@pytest.mark.parametrize("kind", KINDS)
def test_rlt_leaf_unit_evicts_one_random_unmarked_leaf_whole(sglang_plugin: None, kind: str) -> None:
    """unit="leaf": with A marked (the phase is one request long) and B, C unmarked, a one-token eviction
    removes all of B or all of C — whole leaves, never A — and both get chosen across seeds."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    pages = 8
    chosen = {"B": 0, "C": 0}
    for seed in range(16):
        cache, allocator = build_cache(kind, "rlt-leaf", 256, 1, seed=seed, capacity_tokens=pages)
        driver = TreeDriver(cache, allocator, kind)
        seqs = {name: _seq(i + 1, pages, 1) for i, name in enumerate("ABC")}
        for seq in seqs.values():
            driver.serve(seq)
        driver.serve(seqs["A"])  # A is the only marked path now
        assert _evict(cache, 1) == pages  # one whole leaf
        hits = {
            name: int(cache.match_prefix(MatchPrefixParams(key=driver._key(seq))).device_prefix_len)
            for name, seq in seqs.items()
        }
        assert hits["A"] == pages
        assert sorted((hits["B"], hits["C"])) == [0, pages]
        chosen["B" if hits["B"] == 0 else "C"] += 1
        check_invariants_pool(driver, 256)
    assert chosen["B"] > 0 and chosen["C"] > 0, chosen


def check_invariants_pool(driver: TreeDriver, pool: int) -> None:
    cache = driver.cache
    if driver.kind == "unified":
        cache.tree_core.sanity_check([], [])
        in_tree = cache.full_evictable_size() + cache.full_protected_size()
    else:
        in_tree = cache.evictable_size() + cache.protected_size()
    assert in_tree + driver.allocator.available_size() == pool


def test_other_policies_build_sglang_classes_unchanged(sglang_plugin: None) -> None:
    from kvroute.engine_patches.sglang.unified import RLTUnifiedTreeCore
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    for policy in ("lru", "lfu", "slru", "priority"):
        radix, _ = build_cache("radix", policy, POOL)
        assert type(radix) is RadixCache and type(radix.evictable_leaves) is set
        unified, _ = build_cache("unified", policy, POOL)
        assert type(unified) is UnifiedRadixCache
        assert not isinstance(unified.tree_core, RLTUnifiedTreeCore)
        assert type(unified.components[ComponentType.FULL]) is FullComponent


def test_rlt_selects_the_python_tree_core(sglang_plugin: None) -> None:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    cache, _ = build_cache("unified", "rlt", POOL, 4)
    assert isinstance(cache, UnifiedRadixCache)
    assert isinstance(cache.tree_core, UnifiedTreeCore)  # the Python core, not the Rust one
    assert isinstance(cache.components[ComponentType.FULL], FullComponent)


def test_bad_rlt_config_is_a_clear_error(sglang_plugin: None) -> None:
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    with pytest.raises(ValueError, match="seed"):
        get_eviction_strategy("rlt", {"seed": -1})
    with pytest.raises(ValueError, match="capacity_tokens"):
        get_eviction_strategy("rlt", {"capacity_tokens": 0})
    with pytest.raises(ValueError, match="unit"):
        get_eviction_strategy("rlt", {"unit": "token"})
    assert get_eviction_strategy("rlt", {"unit": "leaf"}).unit == "leaf"
    assert get_eviction_strategy("rlt", None).unit == "page"
    with pytest.raises(TypeError):
        get_eviction_strategy("rlt", {"no_such_option": 1})


def test_draw_pages_matches_one_at_a_time_draws() -> None:
    """Two candidates with 2 and 3 pages left: drawing one page at a time, the first is emptied first
    with probability 11/16 (at least 2 of the first 4 uniform draws hit it)."""
    from kvroute.cython_ext.page_draws import PageDraws
    from kvroute.engine_patches.sglang.rlt_core import draw_pages

    rng = PageDraws(7)
    trials = 20000
    first_emptied = 0
    for _ in range(trials):
        taken, n, emptied = draw_pages(rng, np.array([2, 3]), 100)
        assert emptied in (0, 1) and taken.sum() == n and taken[emptied] == (2, 3)[emptied]
        first_emptied += emptied == 0
    assert abs(first_emptied / trials - 11 / 16) < 0.015
    taken, n, emptied = draw_pages(rng, np.array([50, 50, 50]), 10)
    assert (n, emptied, int(taken.sum())) == (10, -1, 10)


def test_page_draws_are_uniform_seeded_and_check_their_arguments() -> None:
    """Many candidates, no one emptied: counts are uniform (chi-square), the same seed repeats the same
    draws, and bad arguments are ValueErrors, not memory errors."""
    from kvroute.cython_ext.page_draws import PageDraws

    m, quota = 300, 300_000
    taken = np.zeros(m, dtype=np.int64)
    n, emptied = PageDraws(3).draw(np.full(m, 10**9, dtype=np.int64), quota, taken)
    assert (n, emptied, int(taken.sum())) == (quota, -1, quota)
    expected = quota / m
    chi2 = float(((taken - expected) ** 2 / expected).sum())  # ~ chi-square, m - 1 = 299 dof: sd 24.5
    assert chi2 < (m - 1) + 6 * (2 * (m - 1)) ** 0.5, chi2
    again = np.zeros(m, dtype=np.int64)
    PageDraws(3).draw(np.full(m, 10**9, dtype=np.int64), quota, again)
    assert (again == taken).all()
    big = np.zeros(70_000, dtype=np.int64)  # more than 2**16 candidates: 32-bit draws
    n, emptied = PageDraws(5).draw(np.full(70_000, 3, dtype=np.int64), 10**6, big)
    assert emptied >= 0 and big[emptied] == 3 and int(big.sum()) == n and big.max() == 3
    # ~3,100 draws (a third draw of one candidate comes after ~(6 x 70,000**2)**(1/3)), spread over all
    # the candidates: some beyond index 2**16, which 16-bit draws could never reach
    assert (big > 0).sum() > 1_000 and np.flatnonzero(big).max() >= 2**16
    with pytest.raises(ValueError, match="room"):
        PageDraws(0).draw(np.array([1, 0], dtype=np.int64), 5, np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="entries"):
        PageDraws(0).draw(np.array([1, 2], dtype=np.int64), 5, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="seed"):
        PageDraws(-1)
    assert PageDraws(0).draw(np.zeros(0, dtype=np.int64), 5, np.zeros(0, dtype=np.int64)) == (0, -1)
