# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Global character-level radix tree shared by all workers (the router's approximate cache view).

Each node stores one edge (a ``str`` slice), its children keyed by first character, a bitmap of the
worker slots that hold it, and per held worker the time it last used the node. Invariants, checked by
``check_invariants``:

- holding is prefix-closed: a worker that holds a node holds every ancestor (inserts mark the whole path,
  trimming removes a worker from its leaves first), so a worker's match is the depth of the deepest
  node on the match path that it holds, plus a partial edge match;
- every non-root node is held by at least one worker (a node losing its last holder is unlinked and
  freed at once);
- ``stored_chars`` is the sum of all edge lengths and never exceeds ``max_chars`` after an insert
  returns; ``worker_chars(w)`` is the sum of edge lengths of the nodes ``w`` holds.

Trimming is per-worker least-recently-used: the (node, worker) pair with the oldest last-use time among
nodes that are leaves *for that worker* loses that worker, until ``stored_chars <= max_chars``.
A lazy min-heap of candidate pairs makes that O(log n) per trimmed pair; stale entries are skipped, and
the heap is rebuilt from the tree when stale entries outnumber live ones.

Memory: per-node times live in a PyMem array of ``popcount(mask)`` doubles (so ``tracemalloc`` sees
them); nodes do not take part in the cyclic GC (the parent link is a borrowed pointer).
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy, memmove

import heapq


cdef extern from "Python.h":
    int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    Py_UCS4 PyUnicode_READ(int kind, void* data, Py_ssize_t index)

cdef extern from *:
    int __builtin_popcountll(unsigned long long x) nogil
    int __builtin_ctzll(unsigned long long x) nogil

cdef enum:
    NWORDS = 4
    MAX_WORKERS = 256  # NWORDS * 64 worker slots


@cython.final
@cython.no_gc
cdef class _Node:
    cdef str edge
    cdef dict children          # first char -> _Node; None while the node has no children
    cdef void* parent           # borrowed: the parent owns this node through its children dict
    cdef uint64_t mask[NWORDS]  # worker slots holding this node
    cdef double* times          # last-use time per held slot, ordered by slot, popcount(mask) long
    cdef bint alive

    def __cinit__(self):
        cdef int i
        for i in range(NWORDS):
            self.mask[i] = 0
        self.times = NULL
        self.parent = NULL
        self.alive = True

    def __dealloc__(self):
        if self.times != NULL:
            PyMem_Free(self.times)
            self.times = NULL


cdef inline bint _has(_Node n, int slot) noexcept:
    return (n.mask[slot >> 6] >> (slot & 63)) & 1


cdef inline int _count(_Node n) noexcept:
    cdef int i, c = 0
    for i in range(NWORDS):
        c += __builtin_popcountll(n.mask[i])
    return c


cdef inline int _rank(_Node n, int slot) noexcept:
    cdef int i, r = 0
    cdef int w = slot >> 6
    cdef int b = slot & 63
    for i in range(w):
        r += __builtin_popcountll(n.mask[i])
    if b:
        r += __builtin_popcountll(n.mask[w] & ((<uint64_t>1 << b) - 1))
    return r


cdef int _set_time(_Node n, int slot, double t) except -1:
    """Records ``t`` for ``slot``; returns 1 if the slot was newly added, 0 if it was already there."""
    cdef int r = _rank(n, slot)
    cdef int cnt
    cdef double* grown
    if _has(n, slot):
        n.times[r] = t
        return 0
    cnt = _count(n)
    grown = <double*>PyMem_Realloc(n.times, (cnt + 1) * sizeof(double))
    if grown == NULL:
        raise MemoryError()
    if cnt > r:
        memmove(&grown[r + 1], &grown[r], (cnt - r) * sizeof(double))
    grown[r] = t
    n.times = grown
    n.mask[slot >> 6] |= (<uint64_t>1 << (slot & 63))
    return 1


cdef void _clear_slot(_Node n, int slot) noexcept:
    cdef int r, cnt
    cdef double* shrunk
    if not _has(n, slot):
        return
    r = _rank(n, slot)
    cnt = _count(n)
    if cnt - r - 1 > 0:
        memmove(&n.times[r], &n.times[r + 1], (cnt - r - 1) * sizeof(double))
    n.mask[slot >> 6] &= ~(<uint64_t>1 << (slot & 63))
    if cnt == 1:
        PyMem_Free(n.times)
        n.times = NULL
    else:
        shrunk = <double*>PyMem_Realloc(n.times, (cnt - 1) * sizeof(double))
        if shrunk != NULL:  # on failure keep the larger block; contents are valid either way
            n.times = shrunk


cdef inline bint _empty(_Node n) noexcept:
    cdef int i
    for i in range(NWORDS):
        if n.mask[i]:
            return False
    return True


cdef inline Py_ssize_t _common(str text, Py_ssize_t pos, str edge, Py_ssize_t m) noexcept:
    """Number of leading characters on which text[pos:pos+m] and edge[:m] agree."""
    cdef int kt = PyUnicode_KIND(text)
    cdef int ke = PyUnicode_KIND(edge)
    cdef char* dt = <char*>PyUnicode_DATA(text)
    cdef char* de = <char*>PyUnicode_DATA(edge)
    cdef Py_ssize_t i
    if kt == ke and memcmp(dt + pos * kt, de, m * kt) == 0:
        return m
    for i in range(m):
        if PyUnicode_READ(kt, dt, pos + i) != PyUnicode_READ(ke, de, i):
            return i
    return m


cdef class PrefixIndex:
    """Character-level radix tree over all workers' prompts, bounded by ``max_chars`` stored characters.

    ``match(text)`` -> ``{worker: matched_chars}`` (workers with a non-empty match) in one walk;
    ``insert(text, worker, now)`` marks ``text`` as held by ``worker``, last used at ``now``;
    ``remove_worker(worker)`` frees everything the worker held. At most 256 workers at a time.
    """

    cdef _Node root
    cdef readonly Py_ssize_t max_chars
    cdef readonly Py_ssize_t stored_chars
    cdef readonly Py_ssize_t node_count
    cdef Py_ssize_t _entries          # sum over nodes of popcount(mask)
    cdef dict _slot_of                # worker id -> slot
    cdef list _name_of                # slot -> worker id or None
    cdef list _free_slots
    cdef Py_ssize_t _worker_chars[MAX_WORKERS]
    cdef list _heap                   # (time, seq, node, slot) candidates for trimming
    cdef long long _seq

    def __cinit__(self, Py_ssize_t max_chars=10_000_000):
        cdef int i
        if max_chars <= 0:
            raise ValueError(f"max_chars must be > 0, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node()
        self.root.edge = ""
        self.stored_chars = 0
        self.node_count = 0
        self._entries = 0
        self._slot_of = {}
        self._name_of = [None] * MAX_WORKERS
        self._free_slots = list(range(MAX_WORKERS - 1, -1, -1))
        for i in range(MAX_WORKERS):
            self._worker_chars[i] = 0
        self._heap = []
        self._seq = 0

    # -- workers ---------------------------------------------------------------------------------------
    cdef int _slot(self, worker, bint create) except -2:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if not create:
            return -1
        if not isinstance(worker, str):
            raise TypeError(f"worker id must be str, got {type(worker).__name__}")
        if not self._free_slots:
            raise ValueError(f"PrefixIndex holds at most {MAX_WORKERS} workers")
        slot = self._free_slots.pop()
        self._slot_of[worker] = slot
        self._name_of[slot] = worker
        return slot

    @property
    def workers(self):
        """Workers that hold at least one character."""
        return [w for w, s in self._slot_of.items() if self._worker_chars[s] > 0]

    def worker_chars(self, worker):
        """Characters held by ``worker`` (0 for an unknown worker)."""
        cdef int slot = self._slot(worker, False)
        return 0 if slot < 0 else self._worker_chars[slot]

    def __len__(self):
        return self.stored_chars

    # -- match -----------------------------------------------------------------------------------------
    cpdef dict match(self, str text):
        """``{worker: matched_chars}`` for every worker whose cached prefix of ``text`` is non-empty."""
        cdef dict result = {}
        cdef _Node node = self.root
        cdef _Node child
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t n = len(text)
        cdef Py_ssize_t k, elen
        cdef uint64_t cur[NWORDS]
        cdef uint64_t gone
        cdef int i, b
        cdef bint started = False
        cdef list names = self._name_of
        if text is None:
            raise TypeError("text must be str")
        for i in range(NWORDS):
            cur[i] = 0
        while pos < n and node.children is not None:
            child = <_Node>node.children.get(text[pos])
            if child is None:
                break
            elen = len(child.edge)
            k = _common(text, pos, child.edge, elen if elen < n - pos else n - pos)
            if started:
                # holding is prefix-closed: workers missing from the child matched exactly `pos` chars
                for i in range(NWORDS):
                    gone = cur[i] & ~child.mask[i]
                    while gone:
                        b = __builtin_ctzll(gone)
                        result[names[i * 64 + b]] = pos
                        gone &= gone - 1
            for i in range(NWORDS):
                cur[i] = child.mask[i]
            started = True
            pos += k
            if k < elen:
                break
            node = child
        if started:
            for i in range(NWORDS):
                gone = cur[i]
                while gone:
                    b = __builtin_ctzll(gone)
                    result[names[i * 64 + b]] = pos
                    gone &= gone - 1
        return result

    # -- insert ----------------------------------------------------------------------------------------
    cpdef Py_ssize_t insert(self, str text, worker, double now) except -1:
        """Marks ``text`` as cached on ``worker`` at ``now``; returns characters newly stored.

        Text longer than ``max_chars`` is truncated to its first ``max_chars`` characters.
        """
        cdef int slot
        cdef _Node node = self.root
        cdef _Node child
        cdef _Node mid
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t n
        cdef Py_ssize_t k, elen, cnt
        cdef Py_ssize_t before = self.stored_chars
        if text is None:
            raise TypeError("text must be str")
        slot = self._slot(worker, True)
        n = len(text)
        if n > self.max_chars:
            text = text[:self.max_chars]
            n = self.max_chars
        if n == 0:
            return 0
        while pos < n:
            key = text[pos]
            child = None if node.children is None else <_Node>node.children.get(key)
            if child is None:
                child = _Node()
                child.edge = text[pos:]
                child.parent = <void*>node
                if node.children is None:
                    node.children = {}
                node.children[key] = child
                self.node_count += 1
                self.stored_chars += n - pos
                _set_time(child, slot, now)
                self._entries += 1
                self._worker_chars[slot] += n - pos
                node = child
                break
            elen = len(child.edge)
            k = _common(text, pos, child.edge, elen if elen < n - pos else n - pos)
            if k < elen:
                # split: `mid` takes the shared part and inherits the child's holders and times
                mid = _Node()
                mid.edge = child.edge[:k]
                child.edge = child.edge[k:]
                for i in range(NWORDS):
                    mid.mask[i] = child.mask[i]
                cnt = _count(child)
                mid.times = <double*>PyMem_Malloc(cnt * sizeof(double))
                if mid.times == NULL:
                    raise MemoryError()
                memcpy(mid.times, child.times, cnt * sizeof(double))
                mid.parent = <void*>node
                mid.children = {child.edge[0]: child}
                child.parent = <void*>mid
                node.children[key] = mid
                self.node_count += 1
                self._entries += cnt
                child = mid
            if _set_time(child, slot, now):
                self._entries += 1
                self._worker_chars[slot] += len(child.edge)
            node = child
            pos += k
        self._seq += 1
        heapq.heappush(self._heap, (now, self._seq, node, slot))
        if len(self._heap) > 2 * self._entries + 4096:
            self._rebuild_heap()
        if self.stored_chars > self.max_chars:
            self._trim()
        return max(0, self.stored_chars - before)

    def set_max_chars(self, Py_ssize_t max_chars) -> None:
        """Change the bound; when the index holds more than the new bound it is trimmed now (least
        recently used per-worker leaves first, as on insert)."""
        if max_chars <= 0:
            raise ValueError(f"max_chars must be > 0, got {max_chars}")
        self.max_chars = max_chars
        if self.stored_chars > self.max_chars:
            self._trim()

    # -- trimming --------------------------------------------------------------------------------------
    cdef int _is_leaf_for(self, _Node node, int slot) except -1:
        cdef _Node ch
        if not node.alive or not _has(node, slot):
            return False
        if node.children is not None:
            for ch in node.children.values():
                if _has(ch, slot):
                    return False
        return True

    cdef int _push(self, _Node node, int slot) except -1:
        self._seq += 1
        heapq.heappush(self._heap, (node.times[_rank(node, slot)], self._seq, node, slot))
        return 0

    cdef int _rebuild_heap(self) except -1:
        cdef list heap = []
        cdef list stack = [self.root]
        cdef _Node node
        cdef _Node ch
        cdef int i, b, slot
        cdef uint64_t leaf_bits[NWORDS]
        cdef uint64_t bits
        while stack:
            node = <_Node>stack.pop()
            for i in range(NWORDS):
                leaf_bits[i] = node.mask[i]
            if node.children is not None:
                for ch in node.children.values():
                    stack.append(ch)
                    if node is not self.root:
                        for i in range(NWORDS):
                            leaf_bits[i] &= ~ch.mask[i]
            if node is self.root:
                continue
            for i in range(NWORDS):
                bits = leaf_bits[i]
                while bits:
                    b = __builtin_ctzll(bits)
                    slot = i * 64 + b
                    self._seq += 1
                    heap.append((node.times[_rank(node, slot)], self._seq, node, slot))
                    bits &= bits - 1
        heapq.heapify(heap)
        self._heap = heap
        return 0

    cdef int _unlink(self, _Node node) except -1:
        """Frees a node that no worker holds any more (it has no children by prefix-closedness)."""
        cdef _Node parent = <_Node>node.parent
        del parent.children[node.edge[0]]
        if not parent.children:
            parent.children = None
        self.stored_chars -= len(node.edge)
        self.node_count -= 1
        node.alive = False
        node.parent = NULL
        return 0

    cdef int _try_merge(self, _Node node) except -1:
        """Merges ``node`` with its only child when both have the same holders (keeps the tree canonical
        after removals, so a removed worker leaves no split points behind). The merged node takes the
        child's last-use times (the older ones: a path's deeper node is never used more recently)."""
        cdef _Node child
        cdef int i, cnt, b, slot
        cdef uint64_t bits
        if node is self.root or not node.alive or node.children is None or len(node.children) != 1:
            return 0
        child = <_Node>next(iter(node.children.values()))
        for i in range(NWORDS):
            if node.mask[i] != child.mask[i]:
                return 0
        cnt = _count(node)
        memcpy(node.times, child.times, cnt * sizeof(double))
        node.edge = node.edge + child.edge
        node.children = child.children
        if node.children is not None:
            for grandchild in node.children.values():
                (<_Node>grandchild).parent = <void*>node
        child.children = None
        child.alive = False
        child.parent = NULL
        self.node_count -= 1
        self._entries -= cnt
        for i in range(NWORDS):  # the child's heap entries died with it: re-offer the merged node
            bits = node.mask[i]
            while bits:
                b = __builtin_ctzll(bits)
                slot = i * 64 + b
                if self._is_leaf_for(node, slot):
                    self._push(node, slot)
                bits &= bits - 1
        return 0

    cdef int _drop(self, _Node node, int slot) except -1:
        """Removes ``slot`` from a node that is a leaf for it; frees the node if nobody holds it."""
        cdef _Node parent = <_Node>node.parent
        self._worker_chars[slot] -= len(node.edge)
        _clear_slot(node, slot)
        self._entries -= 1
        if _empty(node):
            self._unlink(node)
            if parent is not self.root and self._is_leaf_for(parent, slot):
                self._push(parent, slot)
            self._try_merge(parent)
        else:
            self._try_merge(node)
            if parent is not self.root and self._is_leaf_for(parent, slot):
                self._push(parent, slot)
            self._try_merge(parent)
        return 0

    cdef int _trim(self) except -1:
        cdef _Node node
        cdef int slot
        cdef double t
        cdef bint rebuilt = False
        while self.stored_chars > self.max_chars:
            if not self._heap:
                if rebuilt:
                    raise RuntimeError("PrefixIndex: over max_chars with nothing to trim (invariant broken)")
                self._rebuild_heap()
                rebuilt = True
                continue
            t, _, node, slot = heapq.heappop(self._heap)
            if not self._is_leaf_for(node, slot) or node.times[_rank(node, slot)] != t:
                continue  # stale entry
            self._drop(node, slot)
        return 0

    # -- removal ---------------------------------------------------------------------------------------
    def remove_worker(self, worker):
        """Removes every trace of ``worker``; returns the characters it held (0 if unknown)."""
        cdef int slot = self._slot(worker, False)
        cdef list order = []
        cdef list stack
        cdef _Node node
        cdef _Node ch
        cdef Py_ssize_t held
        cdef Py_ssize_t j
        if slot < 0:
            return 0
        held = self._worker_chars[slot]
        stack = [self.root]
        while stack:  # collect the worker's subtree (prefix-closed, so prune where it is absent)
            node = <_Node>stack.pop()
            if node.children is None:
                continue
            for ch in node.children.values():
                if _has(ch, slot):
                    order.append(ch)
                    stack.append(ch)
        for j in range(len(order) - 1, -1, -1):  # deepest first: children go before parents
            node = <_Node>order[j]
            _clear_slot(node, slot)
            self._entries -= 1
            if _empty(node):
                self._unlink(node)
        for j in range(len(order) - 1, -1, -1):  # then re-canonicalize what the worker had split
            node = <_Node>order[j]
            if node.alive:
                self._try_merge(node)
        self._worker_chars[slot] = 0
        del self._slot_of[worker]
        self._name_of[slot] = None
        self._free_slots.append(slot)
        self._heap = [e for e in self._heap if e[3] != slot]
        heapq.heapify(self._heap)
        return held

    def clear(self):
        """Drops everything (all workers)."""
        for w in list(self._slot_of):
            self.remove_worker(w)

    # -- introspection (tests, snapshot) ---------------------------------------------------------------
    def last_used(self, str text, worker):
        """Last-use time ``worker`` recorded on the node covering the last character of ``text``
        (None if that node is not held by ``worker`` or ``text`` is not in the index)."""
        cdef int slot = self._slot(worker, False)
        cdef _Node node = self.root
        cdef _Node child
        cdef Py_ssize_t pos = 0, n = len(text), k, elen
        if slot < 0 or n == 0:
            return None
        while pos < n and node.children is not None:
            child = <_Node>node.children.get(text[pos])
            if child is None:
                return None
            elen = len(child.edge)
            k = _common(text, pos, child.edge, elen if elen < n - pos else n - pos)
            pos += k
            node = child
            if k < elen:
                break
        if pos < n or not _has(node, slot):
            return None
        return node.times[_rank(node, slot)]

    def stats(self):
        return {
            "stored_chars": self.stored_chars,
            "nodes": self.node_count,
            "workers": len(self._slot_of),
            "heap_entries": len(self._heap),
        }

    def check_invariants(self):
        """Walks the whole tree and raises AssertionError if any documented invariant is broken."""
        cdef list stack = [self.root]
        cdef _Node node
        cdef _Node ch
        cdef Py_ssize_t chars = 0, nodes = 0, entries = 0
        cdef Py_ssize_t per_worker[MAX_WORKERS]
        cdef int i, s
        for s in range(MAX_WORKERS):
            per_worker[s] = 0
        while stack:
            node = <_Node>stack.pop()
            if node is not self.root:
                assert node.alive, "dead node reachable"
                assert len(node.edge) > 0, "empty edge"
                assert not _empty(node), "node held by nobody"
                chars += len(node.edge)
                nodes += 1
                entries += _count(node)
                for s in range(MAX_WORKERS):
                    if _has(node, s):
                        assert self._name_of[s] is not None, "node held by a freed slot"
                        per_worker[s] += len(node.edge)
            if node.children is not None:
                assert len(node.children) > 0, "empty children dict kept"
                for key, ch in node.children.items():
                    assert key == ch.edge[0], "child keyed by the wrong character"
                    assert <void*>node == ch.parent, "broken parent link"
                    if node is not self.root:
                        for i in range(NWORDS):
                            assert (ch.mask[i] & ~node.mask[i]) == 0, "holding not prefix-closed"
                    stack.append(ch)
        assert chars == self.stored_chars, f"stored_chars {self.stored_chars} != {chars}"
        assert chars <= self.max_chars, "over max_chars"
        assert nodes == self.node_count, "node_count wrong"
        assert entries == self._entries, "entry count wrong"
        for s in range(MAX_WORKERS):
            assert per_worker[s] == self._worker_chars[s], f"worker_chars wrong for slot {s}"
        return True
