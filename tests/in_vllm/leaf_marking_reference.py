"""A plain-Python model of ``kvroute.cython_ext.leaf_marking.LeafMarking``, for tests only.

Same operations, same random stream (splitmix64 + Lemire's rejection), same order of candidate-array
moves, but built from lists, dicts and sets with no key ids or linked lists: a test runs both on the
same operations and asserts the same victims and the same candidate array. Not used in production.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvroute.cython_ext.leaf_marking import NO_PARENT, UNREGISTERED, seed_state

M64 = (1 << 64) - 1


class ReferenceLeafMarking:
    def __init__(self, num_blocks: int, capacity: int, seed: int) -> None:
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.rng = seed_state(seed)
        self.phase = 0
        self.phases_started = 0
        self._clear()

    def _clear(self) -> None:
        n = self.num_blocks
        self.marked_count = 0
        self.last_marked = -1
        self.mark_phase = [-1] * n
        self.pos = [-1] * n
        self.slots: list[int] = []
        self.n_marked = 0
        self.parent: list[object] = [UNREGISTERED] * n
        self.child_count: dict[Hashable, int] = {}
        self.holders: dict[Hashable, dict[int, None]] = {}  # key -> free holders, in arrival order
        self.own: list[Hashable | None] = [None] * n  # primary key while a free holder

    # ---- random stream ---------------------------------------------------------------------------
    def _next64(self) -> int:
        self.rng = (self.rng + 0x9E3779B97F4A7C15) & M64
        z = self.rng
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def _uniform(self, k: int) -> int:
        m = (self._next64() >> 32) * k
        if (m & 0xFFFFFFFF) < k:
            threshold = ((1 << 32) - k) % k
            while (m & 0xFFFFFFFF) < threshold:
                m = (self._next64() >> 32) * k
        return m >> 32

    # ---- candidates ------------------------------------------------------------------------------
    def _swap(self, i: int, j: int) -> None:
        a, b = self.slots[i], self.slots[j]
        self.slots[i], self.slots[j] = b, a
        self.pos[b], self.pos[a] = i, j

    def add_candidate(self, b: int) -> None:
        if self.pos[b] >= 0:
            return
        self.slots.append(b)
        self.pos[b] = len(self.slots) - 1
        if self.mark_phase[b] == self.phase:
            self._swap(self.pos[b], self.n_marked)
            self.n_marked += 1

    def discard_candidate(self, b: int) -> None:
        i = self.pos[b]
        if i < 0:
            return
        if i < self.n_marked:
            self.n_marked -= 1
            self._swap(i, self.n_marked)
            i = self.n_marked
        self._swap(i, len(self.slots) - 1)
        self.slots.pop()
        self.pos[b] = -1

    # ---- marks and phases ------------------------------------------------------------------------
    def is_marked(self, b: int) -> bool:
        return self.mark_phase[b] == self.phase

    def mark(self, b: int) -> None:
        if self.mark_phase[b] != self.phase:
            if self.marked_count >= self.capacity:
                self.start_phase()
            self.mark_phase[b] = self.phase
            self.marked_count += 1
            if self.pos[b] >= self.n_marked:
                self._swap(self.pos[b], self.n_marked)
                self.n_marked += 1
        self.last_marked = b

    def unmark(self, b: int) -> None:
        if self.mark_phase[b] == self.phase:
            self.marked_count -= 1
            if 0 <= self.pos[b] < self.n_marked:
                self.n_marked -= 1
                self._swap(self.pos[b], self.n_marked)
        self.mark_phase[b] = -1
        if self.last_marked == b:
            self.last_marked = -1

    def start_phase(self, keep: int = -1) -> None:
        self.phase += 1
        self.phases_started += 1
        self.marked_count = 0
        self.n_marked = 0
        if keep >= 0:
            self.mark(keep)

    def draw(self) -> int | None:
        n = len(self.slots)
        if n == 0:
            return None
        if self.n_marked == n:
            keep = self.last_marked
            if keep >= 0 and n == 1 and self.pos[keep] == 0:
                keep = -1
            self.start_phase(keep)
        i = self.n_marked + self._uniform(n - self.n_marked)
        b = self.slots[i]
        self._swap(i, n - 1)
        self.slots.pop()
        self.pos[b] = -1
        return b

    # ---- free holders and the hash chain ---------------------------------------------------------
    def _is_leaf(self, key: Hashable) -> bool:
        return self.child_count.get(key, 0) == 0

    def add_free_cached(self, b: int, key: Hashable) -> None:
        if self.own[b] is not None:
            return
        self.own[b] = key
        self.holders.setdefault(key, {})[b] = None
        if self._is_leaf(key):
            self.add_candidate(b)

    def _unlink(self, b: int) -> None:
        key = self.own[b]
        if key is not None:
            del self.holders[key][b]
            self.own[b] = None

    def take(self, b: int) -> None:
        self._unlink(b)
        self.discard_candidate(b)

    def _free_holders(self, key: Hashable) -> list[int]:
        return list(reversed(self.holders.get(key, {})))  # newest first, as the C lists run

    def register_cached(self, b: int, parent_key: Hashable | None) -> bool:
        if self.parent[b] is not UNREGISTERED:
            return False
        if parent_key is None:
            self.parent[b] = NO_PARENT
            return False
        self.parent[b] = parent_key
        self.child_count[parent_key] = self.child_count.get(parent_key, 0) + 1
        if self.child_count[parent_key] > 1:
            return False
        for h in self._free_holders(parent_key):
            self.discard_candidate(h)
        return True

    def forget_cached(self, b: int) -> Hashable | None:
        self.discard_candidate(b)
        if self.mark_phase[b] >= 0:
            self.unmark(b)
        self._unlink(b)
        parent_key, self.parent[b] = self.parent[b], UNREGISTERED
        if parent_key is UNREGISTERED or parent_key is NO_PARENT:
            return None
        self.child_count[parent_key] -= 1
        if self.child_count[parent_key]:
            return None
        del self.child_count[parent_key]
        for h in self._free_holders(parent_key):
            self.add_candidate(h)
        return parent_key

    def draw_victim(self) -> tuple[int, Hashable | None] | None:
        b = self.draw()
        if b is None:
            return None
        return b, self.forget_cached(b)

    def is_leaf_key(self, key: Hashable) -> bool:
        return self._is_leaf(key)

    def reset(self) -> None:
        self._clear()
        self.phase += 1

    @property
    def children(self) -> dict[Hashable, int]:
        return dict(self.child_count)
