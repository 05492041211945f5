"""The RLT bookkeeping on its own (kvroute.engine_patches.vllm.leaf_marking): candidates, marks, phases."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.engine_patches.vllm.leaf_marking import LeafMarking


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
    assert not s.is_leaf_key("k1")
    assert s.forget_cached(2) is None  # k1 still has block 3
    assert s.forget_cached(3) == "k1"  # k1 lost its last child
    assert s.is_leaf_key("k1")
    assert s.forget_cached(3) is None  # forgetting twice is harmless
    s.check_invariants()


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


class _CountingList(list):
    """A list that counts element writes, to check that a draw touches O(1) slots."""

    writes = 0

    def __setitem__(self, i, v):  # type: ignore[no-untyped-def]
        _CountingList.writes += 1
        super().__setitem__(i, v)

    def pop(self, *a):  # type: ignore[no-untyped-def]
        _CountingList.writes += 1
        return super().pop(*a)

    def append(self, v):  # type: ignore[no-untyped-def]
        _CountingList.writes += 1
        super().append(v)


@pytest.mark.parametrize("n", [16, 20_000])
def test_draw_touches_a_constant_number_of_slots(n: int) -> None:
    s = LeafMarking(n + 1, capacity=n, seed=3)
    for b in range(1, n + 1):
        s.add_candidate(b)
    for b in range(1, n // 2):
        s.mark(b)
    s.slots = _CountingList(s.slots)
    s.pos = _CountingList(s.pos)
    worst = 0
    for _ in range(10):
        _CountingList.writes = 0
        s.draw()
        worst = max(worst, _CountingList.writes)
    assert worst <= 12  # swap-remove (+ a phase change re-marking one block), whatever n is


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "discard", "mark", "unmark", "draw", "victim"]), st.integers(0, 11)),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_random_operations_keep_invariants(ops: list[tuple[str, int]], capacity: int) -> None:
    s = LeafMarking(12, capacity=capacity, seed=0)
    model: set[int] = set()
    for block_id in range(1, 12):  # a chain 0 <- 1 <- ... <- 11 of keys "k0".."k11"
        s.register_cached(block_id, f"k{block_id - 1}")
    s.register_cached(0, None)
    registered = set(range(12))
    for op, b in ops:
        if op == "add":
            s.add_candidate(b)
            model.add(b)
        elif op == "discard":
            s.discard_candidate(b)
            model.discard(b)
        elif op == "mark":
            s.mark(b)
        elif op == "unmark":
            s.unmark(b)
        else:
            unmarked_before = {c for c in model if not s.is_marked(c)}
            phase_before = s.phase
            if op == "draw":
                got = s.draw()
            else:  # draw_victim: the draw plus forgetting the block's chain position
                victim = s.draw_victim()
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
        s.check_invariants()
