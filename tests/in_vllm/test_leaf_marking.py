"""The RLT bookkeeping on its own (kvroute.cython_ext.leaf_marking): candidates, marks, phases, free
holders, key ids; and the same victims as the plain-Python model (leaf_marking_reference) for a seed."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.cython_ext.leaf_marking import LeafMarking
from leaf_marking_reference import ReferenceLeafMarking


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        LeafMarking(0, 1)
    with pytest.raises(ValueError, match="capacity"):
        LeafMarking(4, 0)


def test_draw_takes_only_unmarked_candidates_until_none_is_left() -> None:
    s = LeafMarking(10, capacity=9, seed=1)
    for b in range(1, 7):
        s.add_candidate(b)
    for b in (1, 2, 3):
        s.mark(b)
    drawn = [s.draw() for _ in range(3)]
    assert sorted(drawn) == [4, 5, 6]
    assert s.phase == 0
    # only marked candidates remain: a new phase starts, the most recent mark (3) survives it
    assert s.draw() in (1, 2)
    assert s.phase == 1
    assert s.is_marked(3) and not s.is_marked(1) and not s.is_marked(2)
    s.check_invariants()


def test_phase_starts_when_marks_reach_capacity() -> None:
    s = LeafMarking(10, capacity=3, seed=0)
    for b in (1, 2, 3):
        s.mark(b)
    assert (s.phase, s.marked_count) == (0, 3)
    s.mark(2)  # re-marking a marked block is no new mark
    assert (s.phase, s.marked_count) == (0, 3)
    s.mark(4)  # the 4th distinct block: new phase, and 4 is its first mark
    assert (s.phase, s.marked_count) == (1, 1)
    assert s.is_marked(4) and not s.is_marked(1)
    s.check_invariants()


def test_draw_on_empty_returns_none_and_single_marked_candidate_is_still_drawn() -> None:
    s = LeafMarking(4, capacity=3, seed=0)
    assert s.draw() is None
    s.add_candidate(2)
    s.mark(2)
    assert s.draw() == 2  # the only candidate, marked: a new phase frees it
    assert s.num_candidates == 0


def test_chain_child_counts() -> None:
    s = LeafMarking(8, capacity=7)
    assert s.register_cached(1, None) is False
    assert s.register_cached(2, "k1") is True  # k1 gained its first child
    assert s.register_cached(3, "k1") is False
    assert s.register_cached(3, "k9") is False  # already registered: ignored
    assert not s.is_leaf_key("k1") and s.children == {"k1": 2}
    assert s.forget_cached(2) is None  # k1 still has block 3
    assert s.forget_cached(3) == "k1"  # k1 lost its last child
    assert s.is_leaf_key("k1") and s.children == {}
    assert s.forget_cached(3) is None  # forgetting twice is harmless
    assert s.is_forgotten(3) and not s.is_forgotten(1)
    s.check_invariants()


def test_free_holders_follow_their_keys_children() -> None:
    """A free cached block is a candidate exactly while its primary key has no cached children."""
    s = LeafMarking(8, capacity=7, seed=0)
    s.add_free_cached(1, "k1")  # a leaf: drawable
    s.add_free_cached(4, "k1")  # vLLM does not dedup: a second block holding k1
    assert set(s.slots) == {1, 4}
    assert s.register_cached(2, "k1") is True  # k1 gained a child: its free holders are inner now
    assert s.slots == []
    s.add_free_cached(5, "k1")  # freed while k1 has a child: held, not drawable
    assert s.slots == []
    assert s.forget_cached(2) == "k1"  # the child left: every free holder is a leaf again
    assert set(s.slots) == {1, 4, 5}
    s.take(4)  # a request hit it: no longer free
    assert set(s.slots) == {1, 5}
    s.register_cached(6, "k1")
    s.forget_cached(6)
    assert set(s.slots) == {1, 5}  # the taken block did not come back
    s.check_invariants()


def test_key_ids_are_recycled_and_stay_bounded() -> None:
    """Keys that lost all children and free holders give their ids back (a sweep), so the table stays
    within 3 * num_blocks + 64 ids however many distinct keys pass through."""
    n = 8
    s = LeafMarking(n, capacity=n - 1, seed=0)
    for step in range(2000):
        b = step % n
        s.forget_cached(b)
        s.register_cached(b, f"parent{step}")
        s.add_free_cached(b, f"own{step}")
        assert s.num_key_ids <= 3 * n + 64
    assert s.key_sweeps > 0
    s.check_invariants()
    assert len(s.children) == n and s.num_candidates == n


def test_draw_is_uniform_over_unmarked_candidates() -> None:
    """Chi-square over 15 unmarked candidates (5 marked ones must never come out)."""
    s = LeafMarking(32, capacity=31, seed=1234)
    for b in range(1, 21):
        s.add_candidate(b)
    for b in range(1, 6):
        s.mark(b)
    counts: Counter[int] = Counter()
    n = 30_000
    for _ in range(n):
        b = s.draw()
        counts[b] += 1
        s.add_candidate(b)  # put it back: every draw sees the same 15 unmarked candidates
    assert s.phase == 0
    assert set(counts) == set(range(6, 21))
    expected = n / 15
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 36.12, chi2  # 14 degrees of freedom, p = 0.001


@pytest.mark.parametrize("n", [16, 20_000])
def test_draw_moves_a_constant_number_of_slots(n: int) -> None:
    """A draw is a swap-remove: the candidate array changes in at most 2 places whatever its size."""
    s = LeafMarking(n + 1, capacity=n, seed=3)
    for b in range(1, n + 1):
        s.add_candidate(b)
    for b in range(1, n // 2):
        s.mark(b)
    for _ in range(10):
        before = s.slots
        drawn = s.draw()
        after = s.slots
        assert len(after) == len(before) - 1 and drawn not in after
        # the hole is filled by the last one: one changed place among the remaining ones
        assert sum(x != y for x, y in zip(before[:-1], after, strict=True)) <= 1
    s.check_invariants()


def test_bad_block_ids_and_keys_are_clear_errors() -> None:
    s = LeafMarking(4, capacity=3, seed=0)
    for op in (s.add_candidate, s.mark, s.take, s.forget_cached, s.is_marked):
        with pytest.raises(IndexError, match="block id"):
            op(4)
        with pytest.raises(IndexError, match="block id"):
            op(-1)
    with pytest.raises(TypeError):
        s.mark("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unhashable"):
        s.register_cached(1, ["not", "hashable"])
    with pytest.raises(TypeError, match="seed"):
        LeafMarking(4, 3, seed=1.5)  # type: ignore[arg-type]
    s.check_invariants()


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "discard", "mark", "unmark", "draw", "victim"]), st.integers(0, 11)),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_random_operations_keep_invariants(ops: list[tuple[str, int]], capacity: int) -> None:
    s = LeafMarking(12, capacity=capacity, seed=0)
    ref = ReferenceLeafMarking(12, capacity=capacity, seed=0)
    model: set[int] = set()
    for block_id in range(1, 12):  # a chain 0 <- 1 <- ... <- 11 of keys "k0".."k11"
        s.register_cached(block_id, f"k{block_id - 1}")
        ref.register_cached(block_id, f"k{block_id - 1}")
    s.register_cached(0, None)
    ref.register_cached(0, None)
    registered = set(range(12))
    for op, b in ops:
        if op == "add":
            s.add_candidate(b)
            ref.add_candidate(b)
            model.add(b)
        elif op == "discard":
            s.discard_candidate(b)
            ref.discard_candidate(b)
            model.discard(b)
        elif op == "mark":
            s.mark(b)
            ref.mark(b)
        elif op == "unmark":
            s.unmark(b)
            ref.unmark(b)
        else:
            unmarked_before = {c for c in model if not s.is_marked(c)}
            phase_before = s.phase
            if op == "draw":
                got = s.draw()
                assert ref.draw() == got
            else:  # draw_victim: the draw plus forgetting the block's chain position
                victim = s.draw_victim()
                assert ref.draw_victim() == victim
                got = None if victim is None else victim[0]
                if victim is not None:
                    # a chain: block i's parent key k{i-1} loses its only child when i is forgotten
                    expected_parent = f"k{got - 1}" if got in registered and got > 0 else None
                    assert victim[1] == expected_parent
                    assert s.is_forgotten(got) and (expected_parent is None or s.is_leaf_key(expected_parent))
                    registered.discard(got)
            if not model:
                assert got is None
                continue
            assert got in model
            if unmarked_before:
                assert got in unmarked_before and s.phase == phase_before
            else:
                assert s.phase == phase_before + 1
            model.discard(got)
        assert set(s.slots) == model
        assert s.slots == ref.slots and (s.phase, s.n_marked, s.marked_count) == (
            ref.phase,
            ref.n_marked,
            ref.marked_count,
        )
        s.check_invariants()


POOL_OPS = st.lists(
    st.tuples(
        st.sampled_from(["free", "take", "register", "forget", "mark", "victim"]),
        st.integers(0, 7),
        st.integers(0, 3),  # few keys: duplicate holders and shared parents are common
    ),
    min_size=60,  # long runs: promotions of several free holders of one key need a few steps
    max_size=150,
)


@settings(max_examples=150, deadline=None)
@given(ops=POOL_OPS, capacity=st.integers(1, 8), seed=st.integers(0, 2**64 - 1))
def test_pool_operations_match_the_reference_model(
    ops: list[tuple[str, int, int]], capacity: int, seed: int
) -> None:
    """What the block pool does (free, take, cache with a parent, evict, hit, draw a victim), on both
    implementations with one seed: the same victims, the same candidate array, and the candidates are
    exactly the free holders whose key has no cached children."""
    s = LeafMarking(8, capacity=capacity, seed=seed)
    ref = ReferenceLeafMarking(8, capacity=capacity, seed=seed)
    for op, b, k in ops:
        key = f"k{k}"
        if op == "free":
            s.add_free_cached(b, key)
            ref.add_free_cached(b, key)
        elif op == "take":
            s.take(b)
            ref.take(b)
        elif op == "register":
            parent = None if k == 0 else key
            assert s.register_cached(b, parent) == ref.register_cached(b, parent)
        elif op == "forget":
            assert s.forget_cached(b) == ref.forget_cached(b)
        elif op == "mark":
            s.mark(b)
            ref.mark(b)
        else:
            assert s.draw_victim() == ref.draw_victim()
        assert s.slots == ref.slots
        assert (s.phase, s.n_marked, s.marked_count, s.children) == (
            ref.phase,
            ref.n_marked,
            ref.marked_count,
            ref.children,
        )
        expected = {h for h in range(8) if ref.own[h] is not None and ref.is_leaf_key(ref.own[h])}
        assert set(s.slots) == expected
        s.check_invariants()
