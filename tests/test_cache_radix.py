"""RadixCache behaviour: tree operations, locks, sizes, each policy's choices, argument checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvroute.cache import LruPyCache, RadixCache


def make(policy: str, capacity: int, page_size: int = 1, seed: int = 0):
    if policy == "lru-py":
        return LruPyCache(capacity, page_size=page_size)
    return RadixCache(capacity, page_size=page_size, policy=policy, seed=seed)


ONLINE = ["lru", "rlt", "rlt-leaf", "lru-py"]


# ---------------------------------------------------------------------------------------- tree basics
@pytest.mark.parametrize("policy", ONLINE)
def test_insert_match_split_and_sizes(policy: str) -> None:
    c = make(policy, 100)
    assert c.insert([1, 2, 3, 4, 5]) == 5
    assert c.insert([1, 2, 3, 9, 9]) == 2  # splits after [1, 2, 3]
    assert c.insert([1, 2, 3, 4, 5]) == 0
    assert c.total_size == 7 and c.evictable_size == 7 and c.protected_size == 0
    hit, node = c.match_prefix([1, 2, 3, 4, 7])
    assert hit == 4
    hit, _ = c.match_prefix([1, 2, 3, 9, 9, 9])
    assert hit == 5
    assert c.match_prefix([7, 1])[0] == 0
    assert c.match_prefix([])[0] == 0
    if policy != "lru-py":
        c._debug_check()


@pytest.mark.parametrize("policy", ONLINE)
def test_page_size_aligns_match_and_insert(policy: str) -> None:
    c = make(policy, 100, page_size=4)
    assert c.insert(list(range(10))) == 8  # the partial page is not stored
    assert c.match_prefix(list(range(10)))[0] == 8
    assert c.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])[0] == 4  # mismatch inside page 2
    assert c.insert([0, 1, 2, 3, 4, 5, 99, 7]) == 4
    assert c.total_size == 12
    assert c.evict(1) == 4 if policy == "rlt" else c.evict(1) >= 4


def test_numpy_tokens_are_accepted() -> None:
    c = RadixCache(100, policy="rlt", seed=1)
    assert c.insert(np.arange(10, dtype=np.int32)) == 10
    assert c.match_prefix(np.arange(5, dtype=np.uint16))[0] == 5
    assert c.match_prefix((0, 1, 2))[0] == 3


# ---------------------------------------------------------------------------------------- locks
@pytest.mark.parametrize("policy", ONLINE)
def test_lock_protects_path_and_unlock_restores(policy: str) -> None:
    c = make(policy, 10)
    c.insert([1, 2, 3, 4])
    c.insert([5, 6, 7])
    hit, node = c.match_prefix([1, 2, 3, 4])
    assert hit == 4
    c.lock(node)
    c.lock(node)
    assert c.protected_size == 4 and c.evictable_size == 3
    assert c.evict(100) == 3  # only the unlocked leaf goes
    assert c.match_prefix([1, 2, 3, 4])[0] == 4
    # everything else locked: an insert stores only what fits
    assert c.insert([8, 8, 8, 8, 8, 8, 8, 8]) == 6
    assert c.total_size == 10
    c.unlock(node)
    assert c.protected_size == 4
    c.unlock(node)
    assert c.protected_size == 0 and c.evictable_size == 10
    with pytest.raises(ValueError, match="not locked"):
        c.unlock(node)
    assert c.evict(100) == 10
    assert c.total_size == 0
    with pytest.raises(ValueError, match="evicted"):
        c.lock(node)


@pytest.mark.parametrize("policy", ONLINE)
def test_lock_survives_split(policy: str) -> None:
    c = make(policy, 20)
    c.insert([1, 2, 3, 4, 5, 6])
    _, node = c.match_prefix([1, 2, 3, 4, 5, 6])
    c.lock(node)
    c.insert([1, 2, 3, 9])  # splits the locked node; the new upper part inherits the lock
    assert c.protected_size == 6 and c.evictable_size == 1
    c.unlock(node)
    assert c.protected_size == 0 and c.evictable_size == 7


def test_lock_rejects_foreign_and_wrong_type() -> None:
    a, b = RadixCache(10), RadixCache(10)
    a.insert([1, 2])
    _, node = a.match_prefix([1, 2])
    with pytest.raises(ValueError, match="another cache"):
        b.lock(node)
    with pytest.raises(TypeError, match="Node"):
        a.lock("node")
    with pytest.raises(TypeError, match="node"):
        LruPyCache(10).unlock(3)


# ---------------------------------------------------------------------------------------- policies
@pytest.mark.parametrize("policy", ["lru", "lru-py"])
def test_lru_evicts_least_recent_whole_leaves(policy: str) -> None:
    c = make(policy, 12)
    c.insert([1, 1, 1, 1])
    c.insert([2, 2, 2, 2])
    c.insert([3, 3, 3, 3])
    c.match_prefix([1, 1, 1, 1])  # touches leaf 1: leaf 2 is now the oldest
    assert c.evict(1) == 4  # whole leaf, as SGLang
    assert c.match_prefix([2, 2, 2, 2])[0] == 0
    assert c.match_prefix([1, 1, 1, 1])[0] == 4
    # a partial match splits the leaf; the untouched lower half keeps its old access time
    c.match_prefix([3, 3])
    assert c.evict(1) == 2
    assert c.match_prefix([3, 3, 3, 3])[0] == 2
    # parent becomes a leaf once its children are gone
    c2 = make(policy, 20)
    c2.insert([5, 5, 6, 6])
    c2.insert([5, 5, 7, 7])
    c2.insert([9, 9])
    c2.match_prefix([9, 9])
    assert c2.evict(4) == 4  # both [6, 6] and [7, 7] leaves (older than [9, 9])
    assert c2.evict(1) == 2  # then [5, 5], which became a leaf, still older than [9, 9]
    assert c2.match_prefix([9, 9])[0] == 2


def test_rlt_marks_phases_and_draws_only_unmarked() -> None:
    c = RadixCache(10, policy="rlt", seed=3)
    c.insert([1, 1, 1])
    c.insert([2, 2, 2])
    assert c.marked_tokens == 6 and c.n_candidates == 0
    c.insert([3, 3, 3])
    assert c.marked_tokens == 9
    # marking the 10th distinct token starts a new phase that keeps the last path marked
    c.match_prefix([3, 3, 3])
    assert c.insert([4]) == 1
    assert c.phases == 1
    assert c.marked_tokens == 1  # only the most recently accessed path ([4]) stays marked
    assert c.n_candidates == 3
    c.match_prefix([1, 1, 1])  # re-marks leaf 1
    assert c.marked_tokens == 4 and c.n_candidates == 2
    assert c.evict(4) == 4
    assert c.match_prefix([1, 1, 1])[0] == 3 and c.match_prefix([4])[0] == 1
    assert c.phases == 1
    c._debug_check()


def test_rlt_new_phase_when_no_unmarked_candidate() -> None:
    c = RadixCache(100, policy="rlt", seed=0)
    for t in range(5):
        c.insert([t] * 4)
    assert c.n_candidates == 0 and c.phases == 0
    assert c.evict(2) == 2
    assert c.phases == 1
    assert c.match_prefix([4] * 4)[0] == 4  # the last accessed path kept its mark
    c._debug_check()


def test_rlt_insert_evicts_and_seed_reproduces() -> None:
    def run(seed: int) -> list[int]:
        rng = random.Random(7)
        c = RadixCache(200, policy="rlt", seed=seed)
        hits = []
        for _ in range(300):
            seq = [rng.randrange(6)] + [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
            hits.append(c.match_prefix(seq)[0])
            c.insert(seq)
            assert c.total_size <= 200
        c._debug_check()
        return hits

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_rlt_leaf_draws_only_unmarked_leaves_and_takes_them_whole() -> None:
    c = RadixCache(100, policy="rlt-leaf", seed=5)
    assert c.policy == "rlt-leaf"
    c.insert([9, 9])
    c.insert([9, 9, 1, 1, 1, 1])
    c.insert([9, 9, 2, 2])
    c.insert([3, 3, 3])
    # all is marked: a new phase keeps only [3, 3, 3] marked; candidates [1]*4 and [2]*2, drawn whole
    freed = c.evict(1)
    assert c.phases == 1 and c._peek([3, 3, 3]) == 3
    kept = [c._peek([9, 9, 1, 1, 1, 1]), c._peek([9, 9, 2, 2])]
    c._debug_check()
    if freed == 2:  # [2, 2] went whole, [1]*4 is the last unmarked leaf
        assert kept == [6, 2] and c.evict(1) == 4 and c._peek([9, 9, 1, 1, 1, 1]) == 2
    else:  # [1]*4 went whole
        assert (freed, kept) == (4, [2, 4]) and c.evict(1) == 2 and c._peek([9, 9, 2, 2]) == 2
    assert c.phases == 1 and c._peek([3, 3, 3]) == 3  # the marked leaf was never drawn
    # now the shared parent [9, 9] is an unmarked leaf: the only candidate besides marked [3, 3, 3]
    assert c.n_candidates == 1 and c.evict(1) == 2 and c._peek([9, 9]) == 0
    assert (c.phases, c.total_size) == (1, 3)
    # nothing unmarked is left: a new phase; only the last path is left, so an explicit evict takes it
    assert c.evict(1) == 3 and c.total_size == 0 and c.phases == 2
    assert c.evict(5) == 0
    c._debug_check()


def test_rlt_leaf_evict_frees_whole_leaves_until_enough() -> None:
    c = RadixCache(100, page_size=2, policy="rlt-leaf", seed=0)
    for t in range(6):
        c.insert([t] * 6)
    c.match_prefix([0] * 6)  # last path: leaf 0 stays marked after the phase turns over
    assert c.evict(7) == 12  # two whole 6-token leaves: at least 7, whole leaves only
    assert c.evict(0) == 0 and c.total_size == 24 and c._peek([0] * 6) == 6
    c._debug_check()


def test_rlt_leaf_both_candidates_get_drawn_across_seeds() -> None:
    first_gone = []
    for seed in range(40):
        c = RadixCache(100, policy="rlt-leaf", seed=seed)
        c.insert([1, 1, 1])
        c.insert([2, 2, 2])
        c.insert([3, 3, 3])  # last accessed: stays marked in the new phase
        assert c.evict(1) == 3
        first_gone.append(1 if c._peek([1, 1, 1]) == 0 else 2)
        assert c._peek([3, 3, 3]) == 3
    assert first_gone.count(1) >= 5 and first_gone.count(2) >= 5
    # the seed reproduces its draws
    again = []
    for seed in range(40):
        c = RadixCache(100, policy="rlt-leaf", seed=seed)
        for t in (1, 2, 3):
            c.insert([t] * 3)
        c.evict(1)
        again.append(1 if c._peek([1, 1, 1]) == 0 else 2)
    assert again == first_gone


def test_opt_evicts_farthest_next_use_and_checks_trace() -> None:
    trace = [[1, 1, 1], [2, 2, 2], [3, 3, 3], [1, 1, 1], [2, 2, 2]]
    c = RadixCache.with_future(6, trace)
    assert c.policy == "opt"
    hits = []
    for seq in trace:
        hits.append(c.match_prefix(seq)[0])
        c.insert(seq)
        c._debug_check()
    # inserting [3,3,3] must evict [2,2,2] (next used at 4), not [1,1,1] (next used at 3)... Belady
    # keeps the sooner one: [1] hits fully; [2] was evicted and misses.
    assert hits == [0, 0, 0, 3, 0]
    with pytest.raises(ValueError, match="beyond the end"):
        c.insert([1, 1, 1])
    c2 = RadixCache.with_future(6, trace)
    with pytest.raises(ValueError, match="differs from the future trace"):
        c2.insert([2, 2, 2])


# ---------------------------------------------------------------------------------------- lru == lru-py
@pytest.mark.parametrize("page_size", [1, 2])
def test_lru_py_makes_the_same_decisions_as_cython_lru(page_size: int) -> None:
    rng = random.Random(11)
    a, b = RadixCache(60, page_size=page_size, policy="lru"), LruPyCache(60, page_size=page_size)
    seqs: list[list[int]] = []
    for _ in range(1500):
        if seqs and rng.random() < 0.6:
            base = rng.choice(seqs)
            seq = base[: rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(8))]
        else:
            seq = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        seqs.append(seq)
        (ha, na), (hb, nb) = a.match_prefix(seq), b.match_prefix(seq)
        assert ha == hb
        lock = rng.random() < 0.1
        if lock:
            a.lock(na)
            b.lock(nb)
        assert a.insert(seq) == b.insert(seq)
        if lock:
            a.unlock(na)
            b.unlock(nb)
        if rng.random() < 0.1:
            k = rng.randrange(12)
            assert a.evict(k) == b.evict(k)
        assert (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"capacity_tokens": -1}, ValueError, "capacity_tokens"),
        ({"capacity_tokens": 1.5}, TypeError, "capacity_tokens"),
        ({"capacity_tokens": True}, TypeError, "capacity_tokens"),
        ({"capacity_tokens": 10, "page_size": 0}, ValueError, "page_size"),
        ({"capacity_tokens": 10, "policy": "fifo"}, ValueError, "unknown policy 'fifo'.*rlt-leaf"),
        ({"capacity_tokens": 10, "policy": "RLT-leaf"}, ValueError, "unknown policy 'RLT-leaf'"),
        ({"capacity_tokens": 10, "policy": 3}, TypeError, "policy"),
        ({"capacity_tokens": 10, "policy": "opt"}, ValueError, "with_future"),
        ({"capacity_tokens": 10, "seed": "x"}, TypeError, "seed"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        RadixCache(**kwargs)


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize(
    ("tokens", "exc", "words"),
    [
        ([1, "a"], TypeError, "position 1"),
        ([1, 2.0], TypeError, "float"),
        ([True], TypeError, "bool"),
        ([1, -3], ValueError, ">= 0"),
        ("abc", TypeError, "sequence of ints"),
        (None, TypeError, "sequence of ints"),
        (5, TypeError, "sequence of ints"),
    ],
)
def test_tokens_must_be_non_negative_ints(policy: str, tokens: object, exc: type, words: str) -> None:
    c = make(policy, 10)
    with pytest.raises(exc, match=words):
        c.insert(tokens)
    with pytest.raises(exc, match=words):
        c.match_prefix(tokens)
    assert c.total_size == 0


def test_bad_numpy_and_huge_tokens() -> None:
    c = RadixCache(10)
    with pytest.raises(TypeError, match="dtype"):
        c.insert(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=">= 0"):
        c.insert(np.array([1, -2]))
    with pytest.raises(ValueError, match="64 bits"):
        c.insert([2**70])


@pytest.mark.parametrize("policy", ONLINE)
def test_evict_rejects_bad_counts(policy: str) -> None:
    c = make(policy, 10)
    with pytest.raises(ValueError, match="n_tokens"):
        c.evict(-1)
    with pytest.raises(TypeError, match="n_tokens"):
        c.evict(1.5)
    assert c.evict(0) == 0


def test_with_future_rejects_bad_trace() -> None:
    with pytest.raises(TypeError, match="trace"):
        RadixCache.with_future(10, "abc")
    with pytest.raises(TypeError, match=r"trace\[1\]\[0\]"):
        RadixCache.with_future(10, [[1], ["x"]])
    with pytest.raises(ValueError, match="negative"):
        RadixCache.with_future(10, [[1, -1]])
    with pytest.raises(ValueError, match="capacity_tokens"):
        RadixCache.with_future(-5, [[1]])


def test_read_only_attributes() -> None:
    c = RadixCache(10, page_size=2, policy="rlt")
    assert (c.capacity_tokens, c.page_size, c.policy) == (10, 2, "rlt")
    assert RadixCache(10, policy="rlt-leaf").policy == "rlt-leaf"
    with pytest.raises(AttributeError):
        c.capacity_tokens = 5


def test_trees_are_freed_without_the_cyclic_gc() -> None:
    """Node is untracked by the GC (big trees made gen-2 passes slow): dropping a cache frees every
    node, including nodes callers still held, once they are dropped too."""
    from kvroute.cython_ext.radix_cache import live_nodes

    base = live_nodes()
    rng = random.Random(3)
    trace = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    for make_one in (
        lambda: RadixCache(120, policy="lru"),
        lambda: RadixCache(120, policy="rlt", seed=1),
        lambda: RadixCache(120, policy="rlt-leaf", seed=1),
        lambda: RadixCache.with_future(120, trace),
    ):
        cache = make_one()
        held = []
        for seq in trace:
            hit, node = cache.match_prefix(seq)
            held.append(node)
            cache.insert(seq)
        del node
        assert live_nodes() > base
        del cache
        assert live_nodes() > base  # held nodes (and their ancestors) stay valid objects
        held.clear()
        assert live_nodes() == base


def test_a_cache_in_a_reference_cycle_is_freed_by_the_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache the cyclic GC frees (here it refers to itself; a failed test's traceback does the same)
    frees its nodes without touching a cleared root (that read a field of None and crashed)."""
    import gc
    import sys

    from kvroute.cython_ext.radix_cache import live_nodes

    ignored: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u.exc_value))
    trace = [[i % 3, i, i + 1, i + 2] for i in range(30)]
    base = live_nodes()
    for make_one in (
        lambda: RadixCache(60, policy="lru"),
        lambda: RadixCache(60, policy="rlt", seed=1),
        lambda: RadixCache(60, policy="rlt-leaf", seed=1),
        lambda: RadixCache.with_future(60, trace),
    ):
        cache = make_one()
        for seq in trace:
            cache.insert(seq)
        cache.me = cache
        del cache
        gc.collect()
        assert live_nodes() == base
    assert ignored == []


def test_rlt_phase_turning_over_inside_an_insert_keeps_only_the_new_path() -> None:
    """Algorithm 1 marks each new token before evicting for it: the 10th distinct token (the first
    new one here) starts a new phase in which the earlier leaves are all unmarked candidates."""
    touched_third = 0
    for seed in range(30):
        c = RadixCache(10, policy="rlt", seed=seed)
        for t in (1, 2, 3):
            c.insert([t] * 3)
        assert (c.marked_tokens, c.phases) == (9, 0)
        assert c.insert([4] * 3) == 3
        assert (c.phases, c.marked_tokens, c.total_size) == (1, 3, 10)
        touched_third += c.match_prefix([3] * 3)[0] < 3
        c._debug_check()
    assert touched_third > 0  # the previous request's leaf is a candidate again in the new phase


def test_rlt_leaf_phase_turning_over_inside_an_insert_draws_whole_leaves() -> None:
    """As for rlt, the first new token of [4]*3 is the 10th distinct one: it starts the new phase and
    the room is made from the earlier leaves, now unmarked, but whole ones (3 tokens for 2 asked)."""
    gone = set()
    for seed in range(30):
        c = RadixCache(10, policy="rlt-leaf", seed=seed)
        for t in (1, 2, 3):
            c.insert([t] * 3)
        assert c.insert([4] * 3) == 3
        assert (c.phases, c.marked_tokens, c.total_size) == (1, 3, 9)
        gone |= {t for t in (1, 2, 3) if c._peek([t] * 3) == 0}
        assert sum(c._peek([t] * 3) for t in (1, 2, 3)) == 6
        c._debug_check()
    assert gone == {1, 2, 3}  # the previous request's leaf is a candidate again in the new phase
