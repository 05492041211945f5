"""RLT marks per node; this checks that it equals Algorithm 1's token-level marking.

A token-level reference (one mark per token, identified by its prefix) is driven with the same
requests; evictions are the cache's own (random) choices, applied to the reference. After every
operation the set of marked tokens and the number of phases must agree.
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.cache import RadixCache

EXAMPLES = int(os.environ.get("KVROUTE_HYPOTHESIS_EXAMPLES", "60"))

Token = tuple[int, ...]


class TokenLevelMarks:
    """Algorithm 1's marking, token by token: a token is its prefix tuple."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.cache: set[Token] = set()
        self.marked: set[Token] = set()
        self.phases = 0
        self.last: Token | None = None

    def _root_path(self, t: Token) -> set[Token]:
        while t and t not in self.cache:  # the last token may be gone: keep its nearest ancestor
            t = t[:-1]
        return {t[:i] for i in range(1, len(t) + 1)}

    def _new_phase(self) -> None:
        self.phases += 1
        self.marked = self._root_path(self.last) if self.last else set()

    def touch(self, t: Token) -> None:
        self.last = t
        if t not in self.marked:
            self.marked.add(t)
            if len(self.marked) >= self.k:
                self._new_phase()

    def match(self, seq: list[int]) -> int:
        hit = 0
        while hit < len(seq) and tuple(seq[: hit + 1]) in self.cache:
            hit += 1
        for i in range(1, hit + 1):
            self.touch(tuple(seq[:i]))
        return hit

    def insert(self, seq: list[int]) -> None:  # the caller made room: no eviction here
        for i in range(1, len(seq) + 1):
            self.cache.add(tuple(seq[:i]))
            self.touch(tuple(seq[:i]))

    def evicted(self, gone: set[Token], new_phase: bool) -> None:
        assert new_phase or not (gone & self.marked), "a marked token was evicted within its phase"
        if new_phase:
            self.cache -= gone
            self._new_phase()
        self.cache -= gone
        self.marked -= gone


ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["insert", "match"]), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
        st.tuples(st.just("evict"), st.integers(1, 12)),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=max(60, EXAMPLES), deadline=None)
@given(
    policy=st.sampled_from(["rlt", "rlt-leaf"]),  # same marking; rlt-leaf's draws take whole leaves
    capacity=st.integers(20, 45),
    seed=st.integers(0, 2**32),
    ops=ops,
)
def test_per_node_marks_equal_token_level_marks(policy: str, capacity: int, seed: int, ops) -> None:
    cache = RadixCache(capacity, policy=policy, seed=seed)
    ref = TokenLevelMarks(capacity)

    def evict(n: int) -> None:
        before = set(cache._token_marks())
        phases = cache.phases
        cache.evict(n)
        assert cache.phases - phases <= 1
        ref.evicted(before - set(cache._token_marks()), cache.phases != phases)

    def room() -> int:  # evictable without touching the most recently accessed path (no fallback)
        return cache.total_size - (len(ref._root_path(ref.last)) if ref.last else 0)

    for op, arg in ops:
        if op == "match":
            assert cache.match_prefix(arg)[0] == ref.match(arg)
        elif op == "insert":  # as the simulator does: match, lock, evict the shortfall, insert
            hit, node = cache.match_prefix(arg)
            assert hit == ref.match(arg)
            new = len(arg) - hit
            short = new - (capacity - cache.total_size)
            if short > 0:
                held = ref._root_path(ref.last) | {tuple(arg[:i]) for i in range(1, hit + 1)}
                if short > cache.total_size - len(held):  # it would have to take the last path
                    continue
                cache.lock(node)
                evict(short)
                cache.unlock(node)
            ref.match(arg)  # the insert's walk touches the cached part again
            assert cache.insert(arg) == new
            ref.insert(arg)
        else:
            evict(min(arg, room()))
        marks = cache._token_marks()
        assert set(marks) == ref.cache
        assert {t for t, m in marks.items() if m} == ref.marked
        assert cache.phases == ref.phases
        assert cache.marked_tokens == len(ref.marked)
