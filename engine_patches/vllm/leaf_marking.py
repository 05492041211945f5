"""RLT bookkeeping for one vLLM block pool: marks, phases and the leaf candidates, by block id.

Pure policy code: no vLLM import, no I/O, no clock. The block-pool adapter (``block_pool_rlt``) tells it
what happened to a block (cached, hit, freed, taken, evicted) and asks it for a victim.

RLT at block granularity (seed 004, Algorithm 1; DESIGN.md §2):
- A block is *marked* when it is cached or hit in the current phase. Marks are cleared in O(1) by
  bumping the phase counter: block b is marked iff ``mark_phase[b] == phase``.
- A new phase starts when the number of marked blocks reaches the pool's capacity (the block being
  marked then is the first mark of the new phase), or when a victim is needed and no unmarked
  candidate is left (the most recently marked block keeps its mark, unless it is the only candidate).
- The victim is drawn uniformly at random among the unmarked *candidates*: cached blocks that no
  request holds (ref count 0) and that are leaves of the hash chain (no cached block continues them).

Invariants (checked by ``check_invariants``):
- ``slots[0:len(slots)]`` is exactly the set of candidates; ``pos[b] == i`` iff ``slots[i] == b``, else
  ``pos[b] == -1``.
- ``slots[0:n_marked]`` are the marked candidates, ``slots[n_marked:]`` the unmarked ones. Adding,
  removing, marking and drawing are O(1) (swaps at the region borders).
- ``marked_count`` is the number of blocks with ``mark_phase[b] == phase`` and never exceeds capacity.
- ``children[k]`` is the number of cached blocks whose registered parent key is ``k`` (absent when 0);
  a block with key ``k`` is a leaf iff ``children.get(k, 0) == 0``.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

NO_PARENT: object = object()  # registered: first block of a chain (or a partial-block entry)
UNREGISTERED: object = object()  # not cached, or cached by a path that records no chain position


class LeafMarking:
    """Candidate set + marks + hash-chain child counts for ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int, capacity: int, seed: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.rng = random.Random(seed)
        self._random = self.rng.random
        self.phase = 0
        self.marked_count = 0
        self.phases_started = 0
        self.last_marked = -1
        self.mark_phase: list[int] = [-1] * num_blocks
        self.pos: list[int] = [-1] * num_blocks
        self.slots: list[int] = []
        self.n_marked = 0
        self.parent: list[object] = [UNREGISTERED] * num_blocks
        self.children: dict[Hashable, int] = {}

    # ---- candidate set (indexed array, marked region first) -------------------------------------
    def _swap(self, i: int, j: int) -> None:
        slots, pos = self.slots, self.pos
        a, b = slots[i], slots[j]
        slots[i], slots[j] = b, a
        pos[b], pos[a] = i, j

    def is_candidate(self, block_id: int) -> bool:
        return self.pos[block_id] >= 0

    def add_candidate(self, block_id: int) -> None:
        """Make a free, cached leaf block drawable (no-op when it already is)."""
        pos = self.pos
        if pos[block_id] >= 0:
            return
        slots = self.slots
        i = len(slots)
        if self.mark_phase[block_id] == self.phase:  # into the marked region: swap with its first unmarked
            j = self.n_marked
            self.n_marked = j + 1
            if j < i:
                other = slots[j]
                slots[j] = block_id
                slots.append(other)
                pos[other] = i
                pos[block_id] = j
                return
        slots.append(block_id)
        pos[block_id] = i

    def discard_candidate(self, block_id: int) -> None:
        """Remove a block from the candidates (taken by a request, evicted, or no longer a leaf)."""
        i = self.pos[block_id]
        if i < 0:
            return
        if i < self.n_marked:  # close the gap inside the marked region first
            self.n_marked -= 1
            self._swap(i, self.n_marked)
            i = self.n_marked
        last = len(self.slots) - 1
        self._swap(i, last)
        self.slots.pop()
        self.pos[block_id] = -1

    @property
    def num_candidates(self) -> int:
        return len(self.slots)

    @property
    def num_unmarked_candidates(self) -> int:
        return len(self.slots) - self.n_marked

    # ---- marks and phases -----------------------------------------------------------------------
    def is_marked(self, block_id: int) -> bool:
        return self.mark_phase[block_id] == self.phase

    def mark(self, block_id: int) -> None:
        """Mark a block that was just cached or hit."""
        if self.mark_phase[block_id] != self.phase:
            if self.marked_count >= self.capacity:
                self._start_phase(keep=-1)  # this block is the first mark of the new phase
            self.mark_phase[block_id] = self.phase
            self.marked_count += 1
            i = self.pos[block_id]
            if i >= self.n_marked:  # a candidate in the unmarked region moves to the marked one
                self._swap(i, self.n_marked)
                self.n_marked += 1
        self.last_marked = block_id

    def unmark(self, block_id: int) -> None:
        """Forget a block's mark (its content left the cache)."""
        if self.mark_phase[block_id] == self.phase:
            self.marked_count -= 1
            i = self.pos[block_id]
            if 0 <= i < self.n_marked:
                self.n_marked -= 1
                self._swap(i, self.n_marked)
        self.mark_phase[block_id] = -1
        if self.last_marked == block_id:
            self.last_marked = -1

    def _start_phase(self, keep: int) -> None:
        self.phase += 1
        self.phases_started += 1
        self.marked_count = 0
        self.n_marked = 0  # every candidate is unmarked now: O(1)
        if keep >= 0:
            self.mark(keep)

    def draw(self) -> int | None:
        """Remove and return a uniformly random unmarked candidate; None when there are no candidates.

        No unmarked candidate left: a new phase starts (keeping the latest mark unless that would leave
        nothing to draw), then the draw goes on.
        """
        n = len(self.slots)
        if n == 0:
            return None
        if self.n_marked == n:
            keep = self.last_marked
            if keep >= 0 and n == 1 and self.pos[keep] == 0:
                keep = -1
            self._start_phase(keep)
        # int(random() * k) rather than randrange: ~5x cheaper; its bias is below 2**-53 per draw.
        slots, pos = self.slots, self.pos
        i = self.n_marked + int(self._random() * (n - self.n_marked))
        block_id = slots[i]
        last = slots.pop()  # swap-remove inside the unmarked region (i >= n_marked)
        if last != block_id:
            slots[i] = last
            pos[last] = i
        pos[block_id] = -1
        return block_id

    def draw_victim(self) -> tuple[int, Hashable | None] | None:
        """``draw`` and ``forget_cached`` of the drawn block in one call (the hot path of an eviction):
        ``(block_id, parent key that just lost its last cached child, or None)``; None: no candidate."""
        slots = self.slots
        n = len(slots)
        if n == 0:
            return None
        if self.n_marked == n:
            block_id = self.draw()  # the phase change, as draw() does it (rare)
        else:  # draw() inlined: this runs once per evicted block
            pos = self.pos
            i = self.n_marked + int(self._random() * (n - self.n_marked))
            block_id = slots[i]
            last = slots.pop()
            if last != block_id:
                slots[i] = last
                pos[last] = i
            pos[block_id] = -1
        self.mark_phase[block_id] = -1  # drawn from the unmarked region: no mark to count down
        if self.last_marked == block_id:
            self.last_marked = -1
        parent_key = self.parent[block_id]
        self.parent[block_id] = UNREGISTERED
        if parent_key is UNREGISTERED or parent_key is NO_PARENT:
            return block_id, None
        count = self.children[parent_key] - 1
        if count:
            self.children[parent_key] = count
            return block_id, None
        del self.children[parent_key]
        return block_id, parent_key

    def is_forgotten(self, block_id: int) -> bool:
        """True when ``forget_cached(block_id)`` would change nothing."""
        return (
            self.parent[block_id] is UNREGISTERED and self.pos[block_id] < 0 and self.mark_phase[block_id] < 0
        )

    # ---- hash-chain relation --------------------------------------------------------------------
    def register_cached(self, block_id: int, parent_key: Hashable | None) -> bool:
        """Record the chain parent of a newly cached block. Returns True when ``parent_key`` just
        gained its first cached child (its blocks stopped being leaves)."""
        if self.parent[block_id] is not UNREGISTERED:
            return False
        if parent_key is None:
            self.parent[block_id] = NO_PARENT
            return False
        self.parent[block_id] = parent_key
        count = self.children.get(parent_key, 0)
        self.children[parent_key] = count + 1
        return count == 0

    def forget_cached(self, block_id: int) -> Hashable | None:
        """A block's content left the cache. Returns the parent key that just lost its last cached
        child (its blocks may have become leaves), else None."""
        if self.pos[block_id] >= 0:
            self.discard_candidate(block_id)
        if self.mark_phase[block_id] >= 0:
            self.unmark(block_id)
        parent_key = self.parent[block_id]
        self.parent[block_id] = UNREGISTERED
        if parent_key is UNREGISTERED or parent_key is NO_PARENT:
            return None
        count = self.children[parent_key] - 1
        if count:
            self.children[parent_key] = count
            return None
        del self.children[parent_key]
        return parent_key

    def parent_of(self, block_id: int) -> object:
        return self.parent[block_id]

    def is_leaf_key(self, key: Hashable) -> bool:
        return key not in self.children

    def reset(self) -> None:
        """Forget everything (the pool dropped its whole prefix cache)."""
        for block_id in self.slots:
            self.pos[block_id] = -1
        self.slots.clear()
        self.n_marked = 0
        self.children.clear()
        self.parent = [UNREGISTERED] * self.num_blocks
        self.mark_phase = [-1] * self.num_blocks
        self.marked_count = 0
        self.last_marked = -1
        self.phase += 1

    # ---- checking -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant in the module docstring does not hold (O(n))."""
        assert 0 <= self.n_marked <= len(self.slots)
        assert len(set(self.slots)) == len(self.slots)
        for i, block_id in enumerate(self.slots):
            assert self.pos[block_id] == i, (block_id, i, self.pos[block_id])
            assert (i < self.n_marked) == (self.mark_phase[block_id] == self.phase), (block_id, i)
        assert sum(p >= 0 for p in self.pos) == len(self.slots)
        assert self.marked_count == sum(p == self.phase for p in self.mark_phase)
        assert self.marked_count <= self.capacity
        counts: dict[Hashable, int] = {}
        for parent_key in self.parent:
            if parent_key is not UNREGISTERED and parent_key is not NO_PARENT:
                counts[parent_key] = counts.get(parent_key, 0) + 1
        assert counts == self.children, "child counts out of sync with registered parents"
