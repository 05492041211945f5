# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""RLT bookkeeping for one vLLM block pool (marks, phases, leaf candidates by block id), plus the fused
loops that vLLM's hot paths call (``take_victims``, ``on_cached``, ``on_touch``, ``on_free``).

``LeafMarking`` is pure policy code: no vLLM import, no I/O, no clock. The block-pool adapter
(``kvroute.engine_patches.vllm.block_pool_rlt``) tells it what happened to a block (cached, hit, freed,
taken, evicted) and asks it for victims. The module-level functions read vLLM's objects by duck typing
(``block.block_id``, ``.ref_cnt``, ``.block_hash``, ``.is_null``, ``.pool``, the pool's free queue) so
that one C call does what a Python loop per block did.

RLT at block granularity (seed 004, Algorithm 1; DESIGN.md §2):
- A block is *marked* when it is cached or hit in the current phase. Marks are cleared in O(1) by
  bumping the phase counter: block b is marked iff ``mark_phase[b] == phase``.
- A new phase starts when the number of marked blocks reaches the pool's capacity (the block being
  marked then is the first mark of the new phase), or when a victim is needed and no unmarked
  candidate is left (the most recently marked block keeps its mark, unless it is the only candidate).
- The victim is drawn uniformly at random among the unmarked *candidates*: cached blocks that no
  request holds (ref count 0) and that are leaves of the hash chain (no cached block continues them).
  Draws come from a seeded splitmix64 stream, exact-uniform through Lemire's rejection: O(1) each.

Representation (why: an eviction touches only C arrays, no Python dict or key object):
- Hash keys are interned to small ints (*key ids*) on the caching/freeing paths. Per key id: the number
  of cached blocks registered as its chain children, and the list of *free holders*: free cached blocks
  whose primary hash is that key (a doubly linked list through the blocks). When a key loses its last
  child, its free holders become candidates; when it gains its first, they stop being candidates.
- Key ids no longer used are recycled lazily (a sweep when ``3 * num_blocks + 64`` ids are in the
  table), so forgetting a block does no dict operation; at most that many keys are kept alive.

Invariants (checked by ``check_invariants``):
- ``slots[0:num_candidates]`` is exactly the set of candidates; ``pos[b] == i`` iff ``slots[i] == b``,
  else ``pos[b] == -1``.
- ``slots[0:n_marked]`` are the marked candidates, ``slots[n_marked:]`` the unmarked ones. Adding,
  removing, marking and drawing are O(1) (swaps at the region borders).
- ``marked_count`` is the number of blocks with ``mark_phase[b] == phase`` and never exceeds capacity.
- ``children(k)`` is the number of blocks whose registered parent key is ``k``; a key is a leaf key iff
  that is 0.
- A free holder is a candidate iff its key is a leaf key; the holder lists are consistent doubly linked
  lists, each block in at most one.
"""

from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, realloc


cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL  # raises for unhashable keys
    PyObject* PyList_GET_ITEM(object lst, Py_ssize_t i)  # borrowed reference
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:  # a __slots__ attribute's descriptor (descrobject.h)
        PyMemberDef* d_member

cdef extern from *:
    """
    #define KVROUTE_PREFETCH(p) __builtin_prefetch((const void*)(p))
    """
    void KVROUTE_PREFETCH(const void* p) noexcept nogil

import os
import types


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NO_PARENT = _Sentinel("NO_PARENT")  # registered: first block of a chain (or a partial-block entry)
UNREGISTERED = _Sentinel("UNREGISTERED")  # not cached, or cached by a path that records no chain position

cdef enum:
    KID_UNREGISTERED = -1  # BlockState.parent_kid: no chain position recorded
    KID_NO_PARENT = -2  # BlockState.parent_kid: first block of its chain
    NONE = -1  # no key id / no block

MAX_BLOCKS = 0x7FFFFFFF  # block ids and key ids are int32


cdef struct BlockState:  # 32 bytes: all an eviction reads or writes about a block, in one place
    int64_t mark_phase  # marked iff == phase; -1: never / forgotten
    int32_t pos  # index in slots, -1: not a candidate
    int32_t parent_kid  # key id of the registered chain parent, or KID_UNREGISTERED / KID_NO_PARENT
    int32_t own_kid  # key id of its primary hash while it is a free holder, else NONE
    int32_t prev_holder  # free-holder list links (block ids), NONE at the ends
    int32_t next_holder
    int32_t _pad


cdef struct KeyState:
    int32_t children  # blocks registered with this key as chain parent
    int32_t holders  # first free holder (block id) or NONE


include "rng.pxi"  # _splitmix64


cdef inline Py_ssize_t _uniform(uint64_t* state, uint64_t k) noexcept nogil:
    """Exactly uniform in [0, k), 1 <= k <= 2**32 (Lemire's multiply-and-reject on 32-bit draws)."""
    cdef uint64_t m = (_splitmix64(state) >> 32) * k
    cdef uint64_t low = m & 0xFFFFFFFFULL
    cdef uint64_t threshold
    if low < k:
        threshold = (0x100000000ULL - k) % k
        while low < threshold:
            m = (_splitmix64(state) >> 32) * k
            low = m & 0xFFFFFFFFULL
    return <Py_ssize_t>(m >> 32)


def seed_state(seed) -> int:
    """The splitmix64 state a seed starts from (``None``: from os.urandom)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return seed & 0xFFFFFFFFFFFFFFFF


cdef class LeafMarking:
    """Candidate set + marks + hash-chain child counts + free holders for ``num_blocks`` block ids."""

    # The def methods take unannotated arguments on purpose: Cython would coerce an ``int`` annotation
    # (1.5 -> 1) where a bad argument must be a TypeError. Block ids are checked (IndexError).

    cdef readonly Py_ssize_t num_blocks
    cdef readonly Py_ssize_t capacity
    cdef readonly int64_t phase
    cdef readonly Py_ssize_t marked_count
    cdef readonly Py_ssize_t phases_started
    cdef readonly Py_ssize_t last_marked
    cdef readonly Py_ssize_t n_marked
    cdef readonly Py_ssize_t key_sweeps
    cdef Py_ssize_t n_slots
    cdef BlockState* blk
    cdef int32_t* slot_ids
    cdef KeyState* keys
    cdef int32_t* free_kids  # stack of recycled key ids
    cdef Py_ssize_t n_keys, key_cap, n_free_kids, sweep_at
    cdef list key_of  # key id -> key (None: recycled)
    cdef dict key_ids  # key -> key id
    cdef uint64_t rng

    def __cinit__(self, *args, **kwargs) -> None:
        self.blk = NULL
        self.slot_ids = NULL
        self.keys = NULL
        self.free_kids = NULL

    def __init__(self, num_blocks, capacity, seed=None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if num_blocks <= 0 or num_blocks > MAX_BLOCKS // 4:
            raise ValueError(f"num_blocks must be in 1..{MAX_BLOCKS // 4}, got {num_blocks}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.rng = <uint64_t>seed_state(seed)
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.sweep_at = 3 * num_blocks + 64
        free(self.blk)  # __init__ called again: start over
        free(self.slot_ids)
        self.blk = <BlockState*>malloc(num_blocks * sizeof(BlockState))
        self.slot_ids = <int32_t*>malloc(num_blocks * sizeof(int32_t))
        if self.blk == NULL or self.slot_ids == NULL:
            raise MemoryError()
        self.phase = 0
        self.phases_started = 0
        self.key_sweeps = 0
        self._clear()

    def __dealloc__(self) -> None:
        free(self.blk)
        free(self.slot_ids)
        free(self.keys)
        free(self.free_kids)

    cdef void _clear(self) except *:
        cdef Py_ssize_t b
        for b in range(self.num_blocks):
            self.blk[b].mark_phase = -1
            self.blk[b].pos = NONE
            self.blk[b].parent_kid = KID_UNREGISTERED
            self.blk[b].own_kid = NONE
            self.blk[b].prev_holder = NONE
            self.blk[b].next_holder = NONE
            self.blk[b]._pad = 0
        self.n_slots = 0
        self.n_marked = 0
        self.marked_count = 0
        self.last_marked = -1
        free(self.keys)
        free(self.free_kids)
        self.keys = NULL
        self.free_kids = NULL
        self.n_keys = self.key_cap = self.n_free_kids = 0
        self.key_of = []
        self.key_ids = {}

    cdef inline Py_ssize_t _check_id(self, block_id) except -1:
        cdef Py_ssize_t b = block_id
        if b < 0 or b >= self.num_blocks:
            raise IndexError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
        return b

    # ---- key ids --------------------------------------------------------------------------------
    cdef inline Py_ssize_t _find_kid(self, object key) except -2:
        """The key id of ``key``, NONE when it has none (raises TypeError for unhashable keys)."""
        cdef PyObject* found = PyDict_GetItemWithError(self.key_ids, key)
        return NONE if found == NULL else <Py_ssize_t><object>found

    cdef Py_ssize_t _kid(self, object key) except -1:
        """The key id of ``key``, made when it has none."""
        cdef Py_ssize_t kid = self._find_kid(key)
        cdef KeyState* grown
        cdef int32_t* grown_free
        if kid >= 0:
            return kid
        if key is None or key is NO_PARENT or key is UNREGISTERED:
            raise ValueError(f"not a hash key: {key!r}")
        if self.n_free_kids == 0 and self.n_keys >= self.sweep_at:
            self._sweep_keys()
        if self.n_free_kids > 0:
            self.n_free_kids -= 1
            kid = self.free_kids[self.n_free_kids]
            self.key_of[kid] = key
        else:
            if self.n_keys == self.key_cap:
                cap = max(64, 2 * self.key_cap)
                grown = <KeyState*>realloc(self.keys, cap * sizeof(KeyState))
                if grown == NULL:
                    raise MemoryError()
                self.keys = grown
                grown_free = <int32_t*>realloc(self.free_kids, cap * sizeof(int32_t))
                if grown_free == NULL:
                    raise MemoryError()
                self.free_kids = grown_free
                self.key_cap = cap
            kid = self.n_keys
            self.n_keys += 1
            self.key_of.append(key)
        self.keys[kid].children = 0
        self.keys[kid].holders = NONE
        self.key_ids[key] = kid
        return kid

    cdef void _sweep_keys(self) except *:
        """Recycle the ids of keys with no children and no free holder (amortized O(1): a sweep
        frees at least ``num_blocks + 64`` ids, since at most ``2 * num_blocks`` are in use)."""
        cdef Py_ssize_t kid
        self.key_sweeps += 1
        for kid in range(self.n_keys):
            key = self.key_of[kid]
            if key is not None and self.keys[kid].children == 0 and self.keys[kid].holders == NONE:
                del self.key_ids[key]
                self.key_of[kid] = None
                self.free_kids[self.n_free_kids] = <int32_t>kid
                self.n_free_kids += 1

    # ---- candidate set (indexed array, marked region first) -------------------------------------
    cdef inline void _swap(self, Py_ssize_t i, Py_ssize_t j) noexcept:
        cdef int32_t a = self.slot_ids[i], b = self.slot_ids[j]
        self.slot_ids[i] = b
        self.slot_ids[j] = a
        self.blk[b].pos = <int32_t>i
        self.blk[a].pos = <int32_t>j

    cdef void _add(self, Py_ssize_t b) noexcept:
        cdef Py_ssize_t i, j
        cdef int32_t other
        if self.blk[b].pos >= 0:
            return
        i = self.n_slots
        self.n_slots = i + 1
        if self.blk[b].mark_phase == self.phase:  # into the marked region: swap with its first unmarked
            j = self.n_marked
            self.n_marked = j + 1
            if j < i:
                other = self.slot_ids[j]
                self.slot_ids[i] = other
                self.blk[other].pos = <int32_t>i
                self.slot_ids[j] = <int32_t>b
                self.blk[b].pos = <int32_t>j
                return
        self.slot_ids[i] = <int32_t>b
        self.blk[b].pos = <int32_t>i

    cdef void _discard(self, Py_ssize_t b) noexcept:
        cdef Py_ssize_t i = self.blk[b].pos, last
        if i < 0:
            return
        if i < self.n_marked:  # close the gap inside the marked region first
            self.n_marked -= 1
            self._swap(i, self.n_marked)
            i = self.n_marked
        last = self.n_slots - 1
        self._swap(i, last)
        self.n_slots = last
        self.blk[b].pos = NONE

    def is_candidate(self, block_id) -> bool:
        return self.blk[self._check_id(block_id)].pos >= 0

    def add_candidate(self, block_id) -> None:
        """Make a block drawable (no-op when it already is). Low level: ``add_free_cached`` is the
        pool's way in, which also keeps the candidate set equal to the free cached leaves."""
        self._add(self._check_id(block_id))

    def discard_candidate(self, block_id) -> None:
        """Remove a block from the candidates (no-op when it is none)."""
        self._discard(self._check_id(block_id))

    @property
    def num_candidates(self) -> int:
        return self.n_slots

    @property
    def num_unmarked_candidates(self) -> int:
        return self.n_slots - self.n_marked

    @property
    def slots(self) -> list[int]:
        """A copy of the candidate array: marked candidates first, then the unmarked ones."""
        return [self.slot_ids[i] for i in range(self.n_slots)]

    @property
    def children(self) -> dict:
        """Keys with cached chain children -> how many (a copy)."""
        return {
            self.key_of[kid]: self.keys[kid].children
            for kid in range(self.n_keys)
            if self.key_of[kid] is not None and self.keys[kid].children > 0
        }

    @property
    def num_key_ids(self) -> int:
        """Key ids in the table (live and not yet recycled)."""
        return self.n_keys - self.n_free_kids

    # ---- marks and phases -----------------------------------------------------------------------
    def is_marked(self, block_id) -> bool:
        return self.blk[self._check_id(block_id)].mark_phase == self.phase

    cdef void _mark(self, Py_ssize_t b) noexcept:
        cdef Py_ssize_t i
        if self.blk[b].mark_phase != self.phase:
            if self.marked_count >= self.capacity:
                self._start_phase(-1)  # this block is the first mark of the new phase
            self.blk[b].mark_phase = self.phase
            self.marked_count += 1
            i = self.blk[b].pos
            if i >= self.n_marked:  # a candidate in the unmarked region moves to the marked one
                self._swap(i, self.n_marked)
                self.n_marked += 1
        self.last_marked = b

    def mark(self, block_id) -> None:
        """Mark a block that was just cached or hit."""
        self._mark(self._check_id(block_id))

    cdef void _unmark(self, Py_ssize_t b) noexcept:
        cdef Py_ssize_t i
        if self.blk[b].mark_phase == self.phase:
            self.marked_count -= 1
            i = self.blk[b].pos
            if 0 <= i < self.n_marked:
                self.n_marked -= 1
                self._swap(i, self.n_marked)
        self.blk[b].mark_phase = -1
        if self.last_marked == b:
            self.last_marked = -1

    def unmark(self, block_id) -> None:
        """Forget a block's mark (its content left the cache)."""
        self._unmark(self._check_id(block_id))

    cdef void _start_phase(self, Py_ssize_t keep) noexcept:
        self.phase += 1
        self.phases_started += 1
        self.marked_count = 0
        self.n_marked = 0  # every candidate is unmarked now: O(1)
        if keep >= 0:
            self._mark(keep)

    def start_phase(self, keep=-1) -> None:
        """Clear every mark (O(1)); ``keep`` >= 0 is marked again as the new phase's first mark."""
        self._start_phase(-1 if keep < 0 else self._check_id(keep))

    cdef Py_ssize_t _draw(self) noexcept:
        """Remove and return a uniformly random unmarked candidate; -1 when there are no candidates."""
        cdef Py_ssize_t n = self.n_slots, keep, i
        cdef int32_t b, last
        if n == 0:
            return -1
        if self.n_marked == n:
            keep = self.last_marked
            if keep >= 0 and n == 1 and self.blk[keep].pos == 0:
                keep = -1
            self._start_phase(keep)
        i = self.n_marked + _uniform(&self.rng, <uint64_t>(n - self.n_marked))
        b = self.slot_ids[i]
        last = self.slot_ids[n - 1]  # swap-remove inside the unmarked region (i >= n_marked)
        self.slot_ids[i] = last
        self.blk[last].pos = <int32_t>i
        self.n_slots = n - 1
        self.blk[b].pos = NONE
        return b

    def draw(self) -> int | None:
        """Remove and return a uniformly random unmarked candidate; None when there are no candidates.

        No unmarked candidate left: a new phase starts (keeping the latest mark unless that would leave
        nothing to draw), then the draw goes on. The block stays registered: ``draw_victim`` also
        forgets it.
        """
        cdef Py_ssize_t b = self._draw()
        return None if b < 0 else b

    # ---- free holders ---------------------------------------------------------------------------
    cdef inline void _unlink_holder(self, Py_ssize_t b) noexcept:
        cdef int32_t kid = self.blk[b].own_kid, prev, nxt
        if kid < 0:
            return
        prev = self.blk[b].prev_holder
        nxt = self.blk[b].next_holder
        if prev >= 0:
            self.blk[prev].next_holder = nxt
        else:
            self.keys[kid].holders = nxt
        if nxt >= 0:
            self.blk[nxt].prev_holder = prev
        self.blk[b].own_kid = NONE
        self.blk[b].prev_holder = NONE
        self.blk[b].next_holder = NONE

    cdef void _free_cached(self, Py_ssize_t b, object key) except *:
        """Block ``b`` is free and cached under primary ``key``: a free holder of it, and a candidate
        when ``key`` is a leaf key."""
        cdef Py_ssize_t kid
        cdef int32_t first
        if self.blk[b].own_kid >= 0:
            return
        kid = self._kid(key)
        first = self.keys[kid].holders
        self.blk[b].own_kid = <int32_t>kid
        self.blk[b].prev_holder = NONE
        self.blk[b].next_holder = first
        if first >= 0:
            self.blk[first].prev_holder = <int32_t>b
        self.keys[kid].holders = <int32_t>b
        if self.keys[kid].children == 0:
            self._add(b)

    def add_free_cached(self, block_id, key) -> None:
        """Block ``block_id`` is free (ref count 0) and cached with primary hash ``key`` (no-op when it is
        already known free): it becomes a candidate when ``key`` has no cached children."""
        self._free_cached(self._check_id(block_id), key)

    cdef inline void _take(self, Py_ssize_t b) noexcept:
        self._unlink_holder(b)
        self._discard(b)

    def take(self, block_id) -> None:
        """Block ``block_id`` left the free queue (a request holds it): no longer a free holder or a
        candidate."""
        self._take(self._check_id(block_id))

    cdef void _promote(self, Py_ssize_t kid) noexcept:
        """Key ``kid`` lost its last child: its free holders are candidates now."""
        cdef int32_t b = self.keys[kid].holders
        while b >= 0:
            self._add(b)
            b = self.blk[b].next_holder

    cdef void _demote(self, Py_ssize_t kid) noexcept:
        """Key ``kid`` gained its first child: its free holders stop being candidates."""
        cdef int32_t b = self.keys[kid].holders
        while b >= 0:
            self._discard(b)
            b = self.blk[b].next_holder

    # ---- hash-chain relation --------------------------------------------------------------------
    cdef Py_ssize_t _forget(self, Py_ssize_t b) noexcept:
        """Block ``b``'s content left the cache. Its parent key's free holders become candidates when
        it was that key's last child; returns that key id, else NONE."""
        cdef int32_t kid
        if self.blk[b].pos >= 0:
            self._discard(b)
        if self.blk[b].mark_phase >= 0:
            self._unmark(b)
        self._unlink_holder(b)
        kid = self.blk[b].parent_kid
        if kid < 0:
            self.blk[b].parent_kid = KID_UNREGISTERED
            return NONE
        self.blk[b].parent_kid = KID_UNREGISTERED
        self.keys[kid].children -= 1
        if self.keys[kid].children > 0:
            return NONE
        self._promote(kid)
        return kid

    def draw_victim(self) -> tuple[int, object] | None:
        """``draw`` and ``forget_cached`` of the drawn block in one call: ``(block_id, parent key that
        just lost its last cached child, or None)``; None: no candidate."""
        cdef Py_ssize_t b = self._draw(), kid
        if b < 0:
            return None
        kid = self._forget(b)
        return b, (None if kid < 0 else self.key_of[kid])

    def forget_cached(self, block_id) -> object:
        """A block's content left the cache: it stops being a candidate, a free holder or a child.
        Returns the parent key that just lost its last cached child (whose free holders became
        candidates), else None."""
        cdef Py_ssize_t kid = self._forget(self._check_id(block_id))
        return None if kid < 0 else self.key_of[kid]

    def is_forgotten(self, block_id) -> bool:
        """True when ``forget_cached(block_id)`` would change nothing."""
        cdef Py_ssize_t b = self._check_id(block_id)
        return (
            self.blk[b].parent_kid == KID_UNREGISTERED
            and self.blk[b].pos < 0
            and self.blk[b].mark_phase < 0
            and self.blk[b].own_kid < 0
        )

    cdef bint _register(self, Py_ssize_t b, object parent_key) except -1:
        cdef Py_ssize_t kid
        if self.blk[b].parent_kid != KID_UNREGISTERED:
            return False
        if parent_key is None:
            self.blk[b].parent_kid = KID_NO_PARENT
            return False
        kid = self._kid(parent_key)
        self.blk[b].parent_kid = <int32_t>kid
        self.keys[kid].children += 1
        if self.keys[kid].children > 1:
            return False
        self._demote(kid)
        return True

    def register_cached(self, block_id, parent_key) -> bool:
        """Record the chain parent of a newly cached block (``None``: first of its chain). Returns True
        when ``parent_key`` just gained its first cached child (its free holders stopped being
        candidates)."""
        return self._register(self._check_id(block_id), parent_key)

    def parent_of(self, block_id) -> object:
        cdef int32_t kid = self.blk[self._check_id(block_id)].parent_kid
        if kid == KID_UNREGISTERED:
            return UNREGISTERED
        if kid == KID_NO_PARENT:
            return NO_PARENT
        return self.key_of[kid]

    def is_leaf_key(self, key) -> bool:
        cdef Py_ssize_t kid = self._find_kid(key)
        return kid < 0 or self.keys[kid].children == 0

    def reset(self) -> None:
        """Forget everything (the pool dropped its whole prefix cache)."""
        self._clear()
        self.phase += 1

    # ---- checking -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant in the module docstring does not hold (O(n))."""
        cdef Py_ssize_t i, b, kid, n_pos = 0, n_marked_blocks = 0, prev, steps
        if not 0 <= self.n_marked <= self.n_slots <= self.num_blocks:
            raise AssertionError(("regions", self.n_marked, self.n_slots))
        for i in range(self.n_slots):
            b = self.slot_ids[i]
            if not 0 <= b < self.num_blocks or self.blk[b].pos != i:
                raise AssertionError(("slot/pos", i, b))
            if (i < self.n_marked) != (self.blk[b].mark_phase == self.phase):
                raise AssertionError(("marked region", i, b))
        children = [0] * self.n_keys
        for b in range(self.num_blocks):
            n_pos += self.blk[b].pos >= 0
            n_marked_blocks += self.blk[b].mark_phase == self.phase
            kid = self.blk[b].parent_kid
            if kid >= 0:
                if kid >= self.n_keys or self.key_of[kid] is None:
                    raise AssertionError(("parent key id", b, kid))
                children[kid] += 1
            kid = self.blk[b].own_kid
            if kid >= 0:
                if kid >= self.n_keys or self.key_of[kid] is None:
                    raise AssertionError(("holder key id", b, kid))
                if (self.blk[b].pos >= 0) != (self.keys[kid].children == 0):
                    raise AssertionError(("free holder is a candidate iff its key is a leaf", b))
            elif self.blk[b].prev_holder != NONE or self.blk[b].next_holder != NONE:
                raise AssertionError(("links on a non-holder", b))
        if n_pos != self.n_slots:
            raise AssertionError(("positions", n_pos, self.n_slots))
        if self.marked_count != n_marked_blocks or self.marked_count > self.capacity:
            raise AssertionError(("marked_count", self.marked_count, n_marked_blocks, self.capacity))
        n_holders = 0
        for kid in range(self.n_keys):
            key = self.key_of[kid]
            if key is None:
                if self.keys[kid].children != 0 or self.keys[kid].holders != NONE:
                    raise AssertionError(("recycled key id in use", kid))
                continue
            if self.key_ids.get(key) != kid:
                raise AssertionError(("key table", kid))
            if self.keys[kid].children != children[kid]:
                raise AssertionError(("child count", key, self.keys[kid].children, children[kid]))
            prev = NONE
            b = self.keys[kid].holders
            steps = 0
            while b >= 0:
                steps += 1
                if steps > self.num_blocks or self.blk[b].own_kid != kid or self.blk[b].prev_holder != prev:
                    raise AssertionError(("holder list", kid, b))
                prev = b
                b = self.blk[b].next_holder
            n_holders += steps
        if len(self.key_ids) != self.n_keys - self.n_free_kids:
            raise AssertionError(("key table size", len(self.key_ids), self.n_keys, self.n_free_kids))
        if n_holders != sum(1 for i in range(self.num_blocks) if self.blk[i].own_kid >= 0):
            raise AssertionError("a free holder is missing from its key's list")


# ---- the vLLM block pool's hot loops (duck-typed: no vLLM import) -----------------------------------


cdef inline void _maybe_free_cached(LeafMarking state, object pool, object block) except *:
    """``block`` may have become free: when it is free, cached, not null and of ``pool``, it is a free
    holder of its primary hash (and a candidate when that is a leaf key)."""
    if block.ref_cnt != 0:
        return
    key = block.block_hash
    if key is None or block.is_null:
        return
    owner = block.pool
    if owner is None or owner is pool:
        state._free_cached(state._check_id(block.block_id), key)


def maybe_free_cached(LeafMarking state not None, object pool, object block) -> None:
    """``block`` is a free holder (and maybe a candidate) when it is free, cached, of ``pool``."""
    _maybe_free_cached(state, pool, block)


def on_free(LeafMarking state not None, object pool, list blocks) -> None:
    """After vLLM's ``free_blocks``/``unpin_blocks``: blocks whose ref count is 0 and that are cached
    in ``pool`` become free holders (candidates when they are leaves)."""
    for block in blocks:
        _maybe_free_cached(state, pool, block)


def on_cached(
    LeafMarking state not None,
    list blocks,
    hashes,
    Py_ssize_t first,
    Py_ssize_t stop,
    make_key,
    group_id,
    block_mask,
) -> None:
    """After vLLM's ``cache_full_blocks``: each block ``i`` in ``first..stop-1`` that now holds the key
    ``make_key(hashes[i], group_id)`` records its chain parent (the key of ``hashes[i - 1]``; a parent
    key gaining its first child stops being a leaf) and is marked. Null blocks, blocks masked out
    (``block_mask[i - first]`` false) and blocks holding other content are skipped, as vLLM skips them.
    """
    cdef Py_ssize_t i, b
    if stop <= first:
        return
    key = make_key(hashes[first - 1], group_id) if first > 0 else None
    for i in range(first, stop):
        parent_key = key
        key = make_key(hashes[i], group_id)
        block = blocks[i]
        if block.is_null or block.block_hash != key:
            continue  # null, or this content is cached under another block (vLLM does not dedup)
        if block_mask is not None and not block_mask[i - first]:
            continue
        b = state._check_id(block.block_id)
        state._register(b, parent_key)
        state._mark(b)


def on_touch(LeafMarking state not None, blocks) -> None:
    """Before vLLM's ``touch``: a hit marks the cached blocks; free ones leave the candidates (vLLM takes
    them out of its free queue)."""
    cdef Py_ssize_t b
    for block in blocks:
        if block.block_hash is None:  # includes the null block
            continue
        b = state._check_id(block.block_id)
        if block.ref_cnt == 0:
            state._take(b)
        state._mark(b)


cdef enum:
    PIPELINE = 4  # victims chosen ahead of their move in the free queue (their memory is prefetched)


cdef object _slots_type = None  # the block class whose slot offsets are below
cdef Py_ssize_t _off_prev = -1, _off_next = -1, _off_hash = -1


cdef Py_ssize_t _slot_offset(object cls, str name) except -2:
    """Byte offset of a ``__slots__`` attribute in instances of ``cls``; -1 when it is no slot."""
    descriptor = getattr(cls, "__dict__", {}).get(name)
    if type(descriptor) is not types.MemberDescriptorType:
        return -1
    return (<PyMemberDescrObject*><PyObject*>descriptor).d_member.offset


cdef void _learn_slots(object cls) except *:
    global _slots_type, _off_prev, _off_next, _off_hash
    _off_prev = _slot_offset(cls, "prev_free_block")
    _off_next = _slot_offset(cls, "next_free_block")
    _off_hash = _slot_offset(cls, "_block_hash")
    _slots_type = cls


cdef inline void _prefetch_block(PyObject* block) noexcept nogil:
    KVROUTE_PREFETCH(block)
    KVROUTE_PREFETCH((<char*>block) + 64)


cdef inline void _prefetch_slot(PyObject* block, Py_ssize_t offset) noexcept nogil:
    # Reads the slot's pointer without touching its reference count, only to hint the CPU: a prefetch
    # never faults and changes nothing, whatever the address.
    if offset >= 0:
        KVROUTE_PREFETCH((<PyObject**>((<char*>block) + offset))[0])


def take_victims(LeafMarking state not None, object pool, Py_ssize_t num_blocks) -> list:
    """Choose the ``num_blocks`` blocks that vLLM's ``get_new_blocks`` will hand out, and move them to
    the head of vLLM's free queue in that order (through the queue's own ``remove``/``prepend_n``).

    Where stock vLLM would reuse a cached block (the free queue's head is cached), the block taken is a
    uniformly random unmarked leaf candidate instead (vLLM's head only when there is no candidate at
    all); a never-cached head is taken as vLLM would take it. Each victim is forgotten at once, so a
    parent left without cached children is a candidate for the next draw of the same call. The caller
    must have checked ``0 < num_blocks <= free blocks``; vLLM then evicts the blocks itself (KV events,
    metrics, ref counts) when it pops them.

    Why a pipeline: victims are random blocks, so moving one in vLLM's linked free queue and evicting
    it later miss the CPU caches (the block, its queue neighbours, its hash key). Each victim is chosen
    ``PIPELINE`` steps before it is moved and its memory is prefetched meanwhile. The blocks chosen but
    not moved yet are still linked in the queue: the head skips them, so the choices are exactly those
    of one-at-a-time moving.
    """
    queue = pool.free_block_queue
    fake_head = queue.fake_free_list_head
    remove = queue.remove
    cdef list pool_blocks = pool.blocks
    cdef list chosen = []
    cdef PyObject* pending[PIPELINE]  # chosen, not moved yet (borrowed: pool.blocks holds them)
    cdef PyObject* picked
    cdef Py_ssize_t i, k, b, n_pending = 0
    cdef bint head_cached, skip
    head = fake_head.next_free_block
    if type(head) is not _slots_type:
        _learn_slots(type(head))
    head_cached = head.block_hash is not None
    for i in range(num_blocks):
        if head_cached:  # reusing the head would evict: RLT picks the victim
            b = state._draw()
            if b < 0:  # no leaf candidate at all: vLLM's LRU head
                picked = <PyObject*>head
                b = state._check_id(head.block_id)
            else:
                picked = PyList_GET_ITEM(pool_blocks, b)
            state._forget(b)  # a parent left childless becomes a candidate for the next draw
        else:  # never cached: taken from the head as vLLM takes it
            picked = <PyObject*>head
        _prefetch_block(picked)
        if picked == <PyObject*>head and i + 1 < num_blocks:  # the next head: skip chosen blocks
            while True:
                head = head.next_free_block
                skip = False
                for k in range(n_pending):
                    skip = skip or pending[k] == <PyObject*>head
                if not skip:
                    break
            head_cached = head.block_hash is not None
        if n_pending == PIPELINE:  # move the oldest chosen block; prefetch what the next move reads
            block = <object>pending[0]
            remove(block)
            chosen.append(block)
            for k in range(1, PIPELINE):
                pending[k - 1] = pending[k]
            n_pending -= 1
            _prefetch_slot(pending[0], _off_prev)
            _prefetch_slot(pending[0], _off_next)
            _prefetch_slot(pending[0], _off_hash)
        pending[n_pending] = picked
        n_pending += 1
    for k in range(n_pending):
        block = <object>pending[k]
        remove(block)
        chosen.append(block)
    queue.prepend_n(chosen)
    return chosen
