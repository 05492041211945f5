# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Token radix tree with eviction policies ``lru`` (SGLang leaf-LRU), ``rlt`` (randomized leaf-token
marking, seed 004 Algorithm 1), ``rlt-leaf`` (the same marking, but a draw evicts the whole drawn
leaf node, as SGLang's ``unit="leaf"`` RLT does) and ``opt`` (Belady, given the future trace).

Invariants (checked by ``_debug_check``):

* Every node except the root holds ``length >= page_size`` tokens, a multiple of ``page_size``;
  ``evictable + protected`` equals the sum of all node lengths and never exceeds ``capacity``.
* ``lock_ref`` of a node is the number of locks held on it or on any descendant; locked tokens are
  ``protected``, the others ``evictable``. Only unlocked leaves are candidates for eviction.
* The candidate structure holds exactly the unlocked leaves (``node.slot >= 0``):
  - ``lru``: an indexed min-heap on ``(last_access, node_id)``;
  - ``opt``: an indexed min-heap on ``(-next_use, node_id)`` (farthest next use on top);
  - ``rlt`` and ``rlt-leaf``: an indexed array partitioned ``[unmarked | marked]``; ``slot <
    n_unmarked`` iff ``node.phase != phase``. A phase reset is O(1): ``phase += 1; n_unmarked =
    n_leaves``. ``rlt-leaf`` is ``rlt`` in every respect (marks, phases, k, candidates, RNG) except
    what one draw evicts: the drawn leaf whole instead of its last page.
* RLT marks per node. Touches (match and insert) always cover whole nodes, because a walk splits the
  node where it stops, and eviction only shortens a leaf from its end, so all tokens of a node always
  share one mark: per-node marking equals token-level marking. ``marked`` is the number of distinct
  marked tokens (sum of lengths of nodes with ``phase == current``); marked tokens are never evicted
  within a phase, and a marked node's ancestors are marked (a touch covers the whole root path).
* RLT phases: when ``marked`` reaches ``capacity`` the phase turns over and only the most recently
  accessed root path stays marked. Inside ``insert``, Algorithm 1 marks each new page before evicting
  for it, so evictions for the pages after the turnover are drawn in the new phase. With no unmarked
  candidate left, a new phase starts; if even then only the most recently accessed path is left, an
  explicit ``evict`` frees it too (uniform draws), because its caller needs the memory. Draws come
  from a seeded splitmix64 stream (``seed``), exact-uniform through Lemire's rejection.
"""

cimport cython
from cpython.ref cimport PyObject
from cpython.dict cimport PyDict_GetItem
from libc.stdint cimport int64_t, uint64_t, INT64_MAX
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

import os
from bisect import bisect_left
from numbers import Integral

import numpy as np

cdef enum:
    POLICY_LRU = 0
    POLICY_RLT = 1
    POLICY_OPT = 2
    POLICY_RLT_LEAF = 3  # constructor code only: the tree runs it as POLICY_RLT with leaf_draws set

POLICY_CODES = {"lru": POLICY_LRU, "rlt": POLICY_RLT, "opt": POLICY_OPT, "rlt-leaf": POLICY_RLT_LEAF}

cdef Py_ssize_t _live_nodes = 0


def live_nodes() -> int:
    """Node objects alive in this process (leak checks: Node is not tracked by the cyclic GC)."""
    return _live_nodes


@cython.no_gc  # trees are large and acyclic except parent<->children; owners break those on dealloc
cdef class FNode:
    """A node of the future trie (``opt`` only): requests (trace indices, ascending) passing through it."""

    cdef readonly Py_ssize_t start
    cdef readonly Py_ssize_t end
    cdef readonly FNode parent
    cdef readonly list reqs
    cdef dict children
    cdef Py_ssize_t src  # a request whose path holds this node's tokens

    def __cinit__(self):
        self.children = {}
        self.reqs = []


@cython.no_gc_clear  # __dealloc__ walks self.root: the cyclic GC must not clear it first
cdef class FutureIndex:
    """Radix trie over the whole future trace; ``next_use(fnode, t)`` is the first request >= t using it."""

    cdef list paths      # list of int64 numpy arrays, page aligned
    cdef list req_nodes  # per request: list of FNode along its path, by depth
    cdef FNode root
    cdef Py_ssize_t page

    def __init__(self, list paths, Py_ssize_t page):
        self.paths = paths
        self.page = page
        self.root = FNode()
        self.root.src = -1
        cdef Py_ssize_t i
        for i in range(len(paths)):
            self._add(i)
        self.req_nodes = [self._path_nodes(i) for i in range(len(paths))]

    cdef object _key(self, const int64_t[::1] p, Py_ssize_t pos):
        if self.page == 1:
            return p[pos]
        return tuple([p[pos + j] for j in range(self.page)])

    cdef void _add(self, Py_ssize_t i):
        cdef const int64_t[::1] p = self.paths[i]
        cdef const int64_t[::1] q
        cdef Py_ssize_t n = p.shape[0], pos = 0, m, lim
        cdef FNode node = self.root, child, new
        cdef object key
        while pos < n:
            key = self._key(p, pos)
            child = node.children.get(key)
            if child is None:
                child = FNode()
                child.start = pos
                child.end = n
                child.parent = node
                child.src = i
                child.reqs.append(i)
                node.children[key] = child
                return
            q = self.paths[child.src]
            lim = min(child.end - child.start, n - pos)
            m = 0
            while m < lim and q[child.start + m] == p[pos + m]:
                m += 1
            m = m // self.page * self.page
            if m < child.end - child.start:
                new = FNode()
                new.start = child.start
                new.end = child.start + m
                new.parent = node
                new.src = child.src
                new.reqs = list(child.reqs)
                child.start += m
                child.parent = new
                new.children[self._key(q, child.start)] = child
                node.children[key] = new
                child = new
            child.reqs.append(i)
            node = child
            pos += m

    cdef list _path_nodes(self, Py_ssize_t i):
        cdef const int64_t[::1] p = self.paths[i]
        cdef Py_ssize_t pos = 0, n = p.shape[0]
        cdef FNode node = self.root
        cdef list out = []
        while pos < n:
            node = node.children[self._key(p, pos)]
            out.append(node)
            pos = node.end
        return out

    def __dealloc__(self):
        _clear_ftree(self.root)

    cdef FNode node_at(self, Py_ssize_t req, Py_ssize_t depth):
        """The future node holding token ``depth`` of request ``req``'s path."""
        cdef FNode f
        for f in self.req_nodes[req]:
            if f.end > depth:
                return f
        raise IndexError("depth beyond the request's path")


cdef void _clear_ftree(FNode root):
    """Break the parent<->children cycles of a future trie (FNode is not tracked by the GC)."""
    if root is None:
        return
    cdef list nodes = [root]
    cdef Py_ssize_t i = 0
    cdef FNode f
    while i < len(nodes):
        f = nodes[i]
        nodes.extend(f.children.values())
        i += 1
    for f in nodes:
        f.children = None


cdef inline FNode _fnode_up(FNode f, Py_ssize_t depth):
    """Walk up from ``f`` to the ancestor holding token ``depth`` (``depth`` lies on f's root path)."""
    while f.start > depth:
        f = f.parent
    return f


@cython.no_gc  # keeps big trees out of the cyclic GC (gen-2 passes took 100-500 ms at 100k nodes)
cdef class Node:
    """A radix-tree node: a run of tokens; the cache hands these out from ``match_prefix``."""

    cdef dict children
    cdef Node parent
    cdef int64_t* buf          # owned; the node's tokens are buf[off : off + length]
    cdef Py_ssize_t off
    cdef Py_ssize_t length
    cdef Py_ssize_t depth      # number of tokens above this node
    cdef Py_ssize_t lock_ref
    cdef int64_t phase         # rlt: == tree.phase means marked
    cdef int64_t last_access   # lru: logical clock of the last touch
    cdef int64_t hkey          # heap key (lru: last_access, opt: -next_use)
    cdef int64_t node_id
    cdef Py_ssize_t slot       # index in the candidate structure, -1 if not a candidate
    cdef bint removed
    cdef void* owner
    cdef FNode fnode           # opt: future node holding this node's last token

    def __cinit__(self):
        global _live_nodes
        self.children = {}
        self.buf = NULL
        self.slot = -1
        self.phase = -1
        _live_nodes += 1

    def __dealloc__(self):
        global _live_nodes
        free(self.buf)
        _live_nodes -= 1

    @property
    def length(self) -> int:
        """Tokens currently stored in this node."""
        return self.length

    @property
    def depth(self) -> int:
        """Tokens on the path above this node."""
        return self.depth

    @property
    def evicted(self) -> bool:
        return self.removed

    @property
    def lock_ref(self) -> int:
        return self.lock_ref

    def __repr__(self) -> str:
        return (f"<Node id={self.node_id} depth={self.depth} length={self.length} "
                f"lock_ref={self.lock_ref}{' evicted' if self.removed else ''}>")


cdef inline bint _heap_less(Node a, Node b):
    return a.hkey < b.hkey or (a.hkey == b.hkey and a.node_id < b.node_id)


include "rng.pxi"


cdef Py_ssize_t _count_draws(Rng* r, PyObject** arr, Py_ssize_t u, Py_ssize_t page, int64_t* rem,
                             int64_t* cnt, Py_ssize_t* touched, Py_ssize_t* n_touched, Py_ssize_t todo,
                             Py_ssize_t* emptied) noexcept:
    """Draw up to ``todo`` uniform candidates in [0, u), counting per candidate; stop at the draw
    that takes a candidate's last page (its index goes to ``emptied``). Returns the draws made.

    ``cnt`` is all zeros on entry; a candidate's remaining pages are read when it is first drawn
    and the drawn ones are listed in ``touched``, so a block costs O(draws), never O(candidates).
    The generator state lives in locals: ``cnt`` may alias it as far as C knows, which would
    otherwise force a reload of the state after every count."""
    cdef Py_ssize_t d = 0, i, nt = 0
    cdef Rng g = r[0]
    cdef uint64_t bound = <uint64_t>u, thresh = _reject_below(bound)
    emptied[0] = -1
    while d < todo:
        i = _try_below(&g, bound, thresh)
        if i < 0:
            continue
        if cnt[i] == 0:
            touched[nt] = i
            nt += 1
            rem[i] = (<Node>arr[i]).length // page
        cnt[i] += 1
        d += 1
        if cnt[i] == rem[i]:
            emptied[0] = i
            break
    r[0] = g
    n_touched[0] = nt
    return d


@cython.no_gc_clear  # __dealloc__ walks self.root; a cache freed by the cyclic GC (e.g. held in a
# reference cycle) had its root cleared to None first, and the walk then read a node field of None
cdef class RadixTree:
    """Cython core of ``kvroute.cache.RadixCache``; argument checking lives in the Python subclass."""

    cdef Py_ssize_t capacity
    cdef Py_ssize_t page
    cdef int pol
    cdef Node root
    cdef Py_ssize_t evictable
    cdef Py_ssize_t protected
    # candidate structure: heap (lru/opt) or partitioned array (rlt)
    cdef PyObject** arr
    cdef Py_ssize_t n_arr
    cdef Py_ssize_t arr_cap
    cdef Py_ssize_t n_unmarked
    # rlt
    cdef int64_t phase
    cdef Py_ssize_t marked
    cdef Node last_touched
    cdef bint leaf_draws       # rlt-leaf: a draw evicts the whole drawn leaf
    cdef Rng rng
    cdef int64_t* rem          # rlt block draws: remaining pages and draws per candidate
    cdef int64_t* cnt
    cdef Py_ssize_t* touched
    cdef Py_ssize_t counts_cap
    # lru
    cdef int64_t tick
    cdef int64_t next_id
    # opt
    cdef FutureIndex future
    cdef Py_ssize_t cursor
    cdef Py_ssize_t n_future
    # scratch buffer for converted tokens
    cdef int64_t* scratch
    cdef Py_ssize_t scratch_cap
    # statistics
    cdef readonly int64_t phases
    cdef readonly int64_t evicted_tokens
    cdef readonly int64_t draw_blocks

    def __cinit__(self, *args, **kwargs):
        self.root = Node()
        self.root.owner = <void*>self
        self.root.node_id = 0
        self.next_id = 1
        self.arr = NULL
        self.scratch = NULL
        self.rem = NULL
        self.cnt = NULL
        self.touched = NULL
        self.phase = 0
        self.page = 1  # valid even if __init__ never runs (page is a divisor everywhere)

    def __dealloc__(self):
        free(self.arr)
        free(self.scratch)
        free(self.rem)
        free(self.cnt)
        free(self.touched)
        # Node is not tracked by the GC: break the parent<->children cycles here (iteratively, so
        # deep trees do not recurse on deallocation)
        cdef list nodes = [self.root]
        cdef Py_ssize_t i = 0
        cdef Node n
        while i < len(nodes):
            n = nodes[i]
            nodes.extend(n.children.values())
            i += 1
        for n in nodes:
            n.children = {}

    def __init__(self, Py_ssize_t capacity, Py_ssize_t page, int policy, object seed,
                 FutureIndex future=None):
        if capacity < 0 or page < 1 or policy not in (POLICY_LRU, POLICY_RLT, POLICY_OPT, POLICY_RLT_LEAF):
            raise ValueError(f"RadixTree: bad capacity={capacity}, page={page} or policy={policy}")
        if policy == POLICY_OPT and future is None:
            raise ValueError("RadixTree: policy opt needs a FutureIndex")
        self.capacity = capacity
        self.page = page
        self.leaf_draws = policy == POLICY_RLT_LEAF
        self.pol = POLICY_RLT if self.leaf_draws else policy
        self.future = future
        self.n_future = len(future.paths) if future is not None else 0
        cdef uint64_t s
        if seed is None:
            s = int.from_bytes(os.urandom(8), "little")
        else:
            s = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        _rng_seed(&self.rng, s)

    # ------------------------------------------------------------------ read-only attributes
    @property
    def capacity_tokens(self) -> int:
        return self.capacity

    @property
    def page_size(self) -> int:
        return self.page

    @property
    def evictable_size(self) -> int:
        return self.evictable

    @property
    def protected_size(self) -> int:
        return self.protected

    @property
    def total_size(self) -> int:
        return self.evictable + self.protected

    @property
    def policy(self) -> str:
        return "rlt-leaf" if self.leaf_draws else ("lru", "rlt", "opt")[self.pol]

    # ------------------------------------------------------------------ token conversion
    cdef Py_ssize_t _load(self, object tokens) except -1:
        """Copy ``tokens`` into the scratch buffer (checked: ints >= 0); returns the page-aligned length."""
        cdef Py_ssize_t n, i
        cdef object x
        cdef int64_t v
        cdef const int64_t[::1] mv
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be one-dimensional, got an array of shape {tokens.shape}")
            if tokens.dtype.kind not in "iu":
                raise TypeError(f"tokens must be integers, got an array of dtype {tokens.dtype}")
            arr = np.ascontiguousarray(tokens, dtype=np.int64)
            n = arr.shape[0]
            self._reserve(n)
            if n:
                mv = arr
                memcpy(self.scratch, &mv[0], n * sizeof(int64_t))
                if arr.min() < 0:
                    raise ValueError("token ids must be >= 0")
        else:
            if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
                raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
            n = len(tokens)
            self._reserve(n)
            i = 0
            for x in tokens:
                if type(x) is int:
                    try:
                        v = x
                    except OverflowError:
                        raise ValueError(f"token id {x} at position {i} does not fit in 64 bits") from None
                elif isinstance(x, Integral) and not isinstance(x, bool):
                    v = int(x)
                else:
                    raise TypeError(f"token ids must be ints, got {type(x).__name__} at position {i}")
                if v < 0:
                    raise ValueError(f"token ids must be >= 0, got {v} at position {i}")
                self.scratch[i] = v
                i += 1
        return n // self.page * self.page

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef int64_t* p
        if n > self.scratch_cap:
            p = <int64_t*>realloc(self.scratch, max(n, 64) * sizeof(int64_t))
            if p == NULL:
                raise MemoryError()
            self.scratch = p
            self.scratch_cap = max(n, 64)
        return 0

    cdef inline object _key(self, const int64_t* p):
        if self.page == 1:
            return p[0]
        return tuple([p[j] for j in range(self.page)])

    # ------------------------------------------------------------------ candidate structure
    cdef int _grow(self) except -1:
        cdef Py_ssize_t cap = max(64, self.arr_cap * 2)
        cdef PyObject** p = <PyObject**>realloc(self.arr, cap * sizeof(PyObject*))
        if p == NULL:
            raise MemoryError()
        self.arr = p
        self.arr_cap = cap
        return 0

    cdef inline void _place(self, Py_ssize_t i, Node n):
        self.arr[i] = <PyObject*>n
        n.slot = i

    cdef void _sift_up(self, Py_ssize_t i):
        cdef Node n = <Node>self.arr[i]
        cdef Node p
        cdef Py_ssize_t j
        while i > 0:
            j = (i - 1) >> 1
            p = <Node>self.arr[j]
            if not _heap_less(n, p):
                break
            self._place(i, p)
            i = j
        self._place(i, n)

    cdef void _sift_down(self, Py_ssize_t i):
        cdef Node n = <Node>self.arr[i]
        cdef Node c, c2
        cdef Py_ssize_t j, size = self.n_arr
        while True:
            j = 2 * i + 1
            if j >= size:
                break
            c = <Node>self.arr[j]
            if j + 1 < size:
                c2 = <Node>self.arr[j + 1]
                if _heap_less(c2, c):
                    j += 1
                    c = c2
            if not _heap_less(c, n):
                break
            self._place(i, c)
            i = j
        self._place(i, n)

    cdef int _add_leaf(self, Node n) except -1:
        """Make the unlocked leaf ``n`` a candidate."""
        cdef Node x
        if self.n_arr == self.arr_cap:
            self._grow()
        if self.pol == POLICY_RLT:
            if n.phase == self.phase or self.n_unmarked == self.n_arr:
                self._place(self.n_arr, n)
            else:
                x = <Node>self.arr[self.n_unmarked]
                self._place(self.n_arr, x)
            self.n_arr += 1
            if n.phase != self.phase:
                self._place(self.n_unmarked, n)
                self.n_unmarked += 1
        else:
            if self.pol == POLICY_LRU:
                n.hkey = n.last_access
            else:
                n.hkey = -self._next_use(n)
            self._place(self.n_arr, n)
            self.n_arr += 1
            self._sift_up(self.n_arr - 1)
        return 0

    cdef void _remove_leaf(self, Node n):
        """Drop ``n`` from the candidates (it got locked, got a child, or is evicted)."""
        cdef Py_ssize_t s = n.slot
        cdef Node x
        if s < 0:
            return
        if self.pol == POLICY_RLT:
            if s < self.n_unmarked:
                self.n_unmarked -= 1
                self._place(s, <Node>self.arr[self.n_unmarked])
                self.n_arr -= 1
                if self.n_unmarked != self.n_arr:
                    self._place(self.n_unmarked, <Node>self.arr[self.n_arr])
            else:
                self.n_arr -= 1
                self._place(s, <Node>self.arr[self.n_arr])
        else:
            self.n_arr -= 1
            if s != self.n_arr:
                x = <Node>self.arr[self.n_arr]
                self._place(s, x)
                self._sift_up(s)
                self._sift_down(x.slot)
        n.slot = -1

    cdef inline void _to_marked(self, Node n):
        """rlt: move a candidate leaf that just got marked to the marked side of the array."""
        cdef Py_ssize_t s = n.slot
        if s >= 0 and s < self.n_unmarked:
            self.n_unmarked -= 1
            self._place(s, <Node>self.arr[self.n_unmarked])
            self._place(self.n_unmarked, n)

    # ------------------------------------------------------------------ policy hooks
    cdef int _touch(self, Node n) except -1:
        if self.pol == POLICY_LRU:
            n.last_access = self.tick
            if n.slot >= 0:
                n.hkey = self.tick
                self._sift_down(n.slot)
        elif self.pol == POLICY_RLT:
            self.last_touched = n
            if n.phase != self.phase:
                n.phase = self.phase
                self.marked += n.length
                self._to_marked(n)
                if self.marked >= self.capacity:
                    self._new_phase()
        return 0

    cdef int _new_phase(self) except -1:
        """rlt: clear every mark in O(1), then re-mark the most recently accessed root path."""
        cdef Node n = self.last_touched
        self.phase += 1
        self.phases += 1
        self.marked = 0
        self.n_unmarked = self.n_arr
        while n is not None and n.removed:
            n = n.parent
        while n is not None and n is not self.root:
            n.phase = self.phase
            self.marked += n.length
            self._to_marked(n)
            n = n.parent
        return 0

    cdef int64_t _next_use(self, Node n):
        """opt: index of the next request (>= cursor) whose path holds n's last token."""
        cdef list reqs = n.fnode.reqs
        cdef Py_ssize_t i = bisect_left(reqs, self.cursor)
        if i == len(reqs):
            return INT64_MAX
        return reqs[i]

    # ------------------------------------------------------------------ structure
    cdef Node _split(self, Node child, Py_ssize_t m):
        """Split ``child`` after its first ``m`` tokens; returns the new upper node."""
        cdef Node new = Node()
        cdef Node parent = child.parent
        new.buf = <int64_t*>malloc(m * sizeof(int64_t))
        if new.buf == NULL:
            raise MemoryError()
        memcpy(new.buf, child.buf + child.off, m * sizeof(int64_t))
        new.length = m
        new.depth = child.depth
        new.parent = parent
        new.lock_ref = child.lock_ref
        new.phase = child.phase
        new.last_access = child.last_access
        new.node_id = self.next_id
        self.next_id += 1
        new.owner = <void*>self
        key = self._key(child.buf + child.off)
        child.off += m
        child.length -= m
        child.depth += m
        child.parent = new
        new.children[self._key(child.buf + child.off)] = child
        parent.children[key] = new
        if self.pol == POLICY_OPT:
            new.fnode = _fnode_up(child.fnode, new.depth + m - 1)
        return new

    cdef Node _walk(self, const int64_t* q, Py_ssize_t n, Py_ssize_t* matched):
        """Follow ``q`` from the root, splitting where it stops inside a node, touching every node."""
        cdef Node node = self.root, child
        cdef PyObject* found
        cdef Py_ssize_t pos = 0, m, lim
        cdef const int64_t* k
        while pos < n:
            found = PyDict_GetItem(node.children, self._key(q + pos))
            if found == NULL:
                break
            child = <Node>found
            k = child.buf + child.off
            lim = min(child.length, n - pos)
            m = 0
            while m < lim and k[m] == q[pos + m]:
                m += 1
            m = m // self.page * self.page
            if m == 0:
                break
            if m < child.length:
                child = self._split(child, m)
            self._touch(child)
            node = child
            pos += m
        matched[0] = pos
        return node

    cdef int _remove_node(self, Node n) except -1:
        """Take the (empty or wholly evicted) leaf ``n`` out of the tree; its parent may become a leaf."""
        cdef Node parent = n.parent
        self._remove_leaf(n)
        del parent.children[self._key(n.buf + n.off)]
        n.removed = True
        n.length = 0
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            if self.pol == POLICY_OPT:
                parent.fnode = _fnode_up(parent.fnode, parent.depth + parent.length - 1)
            self._add_leaf(parent)
        return 0

    # ------------------------------------------------------------------ eviction
    cdef Py_ssize_t _evict(self, Py_ssize_t want) except -1:
        if want <= 0:
            return 0
        if self.pol == POLICY_RLT:
            return self._evict_rlt(want)
        if self.pol == POLICY_LRU:
            return self._evict_lru(want)
        return self._evict_opt(want)

    cdef Py_ssize_t _evict_lru(self, Py_ssize_t want) except -1:
        """SGLang leaf-LRU: evict whole least-recently-touched leaves until ``want`` tokens are freed."""
        cdef Py_ssize_t freed = 0
        cdef Node n
        while freed < want and self.n_arr > 0:
            n = <Node>self.arr[0]
            freed += n.length
            self.evictable -= n.length
            self._remove_node(n)
        self.evicted_tokens += freed
        return freed

    cdef Py_ssize_t _evict_rlt(self, Py_ssize_t want) except -1:
        """Evict one page of a uniformly drawn unmarked unlocked leaf per draw until ``want`` is freed.

        Draws are made in blocks: between two structural changes (a leaf emptied, a phase reset) the
        candidate set is fixed, so the draws only count pages per candidate in a small C array, and
        the block ends at the draw that empties a leaf. This is the same process as drawing and
        evicting one page at a time, without touching a node per draw.
        """
        if self.leaf_draws:
            return self._evict_rlt_leaves(want)
        cdef Py_ssize_t p = self.page, todo = (want + p - 1) // p, done = 0, u, i, d, emptied, nt, k
        cdef bint last_path = False
        cdef Node gone
        while done < todo:
            u = self._draw_range(&last_path)
            if u == 0:
                break
            self._reserve_counts(u)
            self.draw_blocks += 1
            if u <= 0x10000 and u <= 4 * (todo - done) + 64:
                # many draws per candidate: snapshot every candidate, then the tightest loop
                for i in range(u):
                    self.rem[i] = (<Node>self.arr[i]).length
                if p > 1:
                    for i in range(u):
                        self.rem[i] //= p
                d = _count_draws_dense(&self.rng, u, self.rem, self.cnt, todo - done, &emptied)
                gone = <Node>self.arr[emptied] if emptied >= 0 else None
                for i in range(u):
                    if self.cnt[i]:
                        (<Node>self.arr[i]).length -= self.cnt[i] * p
                        self.cnt[i] = 0
            else:
                # few draws among many candidates (e.g. one page from a 100k-leaf tree): O(draws)
                d = _count_draws(&self.rng, self.arr, u, p, self.rem, self.cnt, self.touched, &nt,
                                 todo - done, &emptied)
                gone = <Node>self.arr[emptied] if emptied >= 0 else None
                for k in range(nt):
                    i = self.touched[k]
                    (<Node>self.arr[i]).length -= self.cnt[i] * p
                    self.cnt[i] = 0
            done += d
            if last_path:
                self.marked -= d * p
            if gone is not None:
                self._remove_node(gone)
        self.evictable -= done * p
        self.evicted_tokens += done * p
        return done * p

    cdef Py_ssize_t _draw_range(self, bint* last_path) except -1:
        """How many candidates the next RLT draw is uniform over (0: nothing evictable): the unmarked
        leaves; none left starts a new phase; if only the most recently accessed path is left even
        then (all else locked or gone), all its leaves (``*last_path`` becomes true): an explicit
        evict() must free what it can."""
        if self.n_unmarked == 0 and not last_path[0]:
            if self.n_arr == 0:
                return 0
            self._new_phase()
            last_path[0] = self.n_unmarked == 0
        return self.n_arr if last_path[0] else self.n_unmarked

    cdef Py_ssize_t _evict_rlt_leaves(self, Py_ssize_t want) except -1:
        """rlt-leaf: evict whole uniformly drawn unmarked unlocked leaves until ``want`` tokens are
        freed (it may free more, as lru does) or nothing is evictable. Phases as in ``_evict_rlt``:
        no unmarked candidate left starts a new phase; if only the most recently accessed path is
        left even then, its leaves are drawn too (an explicit evict frees what it can)."""
        cdef Py_ssize_t freed = 0, u
        cdef bint last_path = False
        cdef Node n
        while freed < want:
            u = self._draw_range(&last_path)
            if u == 0:
                break
            self.draw_blocks += 1
            n = <Node>self.arr[_uniform_below(&self.rng, u)]
            freed += n.length
            self.evictable -= n.length
            if n.phase == self.phase:  # last path only: a marked leaf leaves the marked count
                self.marked -= n.length
            self._remove_node(n)  # its parent may become a candidate
        self.evicted_tokens += freed
        return freed

    cdef int _reserve_counts(self, Py_ssize_t u) except -1:
        """Grow the per-candidate scratch arrays to ``u`` entries (``cnt`` stays all zeros)."""
        cdef Py_ssize_t cap = max(u, 2 * self.counts_cap, 64)
        cdef int64_t* a
        cdef int64_t* b
        cdef Py_ssize_t* t
        if u <= self.counts_cap:
            return 0
        a = <int64_t*>realloc(self.rem, cap * sizeof(int64_t))
        if a == NULL:
            raise MemoryError()
        self.rem = a
        b = <int64_t*>calloc(cap, sizeof(int64_t))
        if b == NULL:
            raise MemoryError()
        free(self.cnt)
        self.cnt = b
        t = <Py_ssize_t*>realloc(self.touched, cap * sizeof(Py_ssize_t))
        if t == NULL:
            raise MemoryError()
        self.touched = t
        self.counts_cap = cap
        return 0



    cdef Py_ssize_t _evict_opt(self, Py_ssize_t want) except -1:
        """Belady: evict pages of the leaf whose last token is next used farthest in the future."""
        cdef Py_ssize_t freed = 0, p = self.page, run, k, end
        cdef Node n
        cdef FNode f
        while freed < want and self.n_arr > 0:
            n = <Node>self.arr[0]
            end = n.depth + n.length
            f = n.fnode
            # pages whose last token lies in f share n's next use: evict them together
            run = (end - 1 - max(f.start, n.depth)) // p + 1
            k = min(run, (want - freed + p - 1) // p) * p
            freed += k
            self.evictable -= k
            if k >= n.length:
                self._remove_node(n)
            else:
                n.length -= k
                n.fnode = _fnode_up(f, end - k - 1)
                n.hkey = -self._next_use(n)
                self._sift_up(n.slot)
                self._sift_down(n.slot)
        self.evicted_tokens += freed
        return freed

    # ------------------------------------------------------------------ public operations
    def match_prefix(self, tokens):
        """Longest cached prefix of ``tokens`` (page aligned) -> ``(hit_len, node)``; touches the path."""
        cdef Py_ssize_t n = self._load(tokens), matched = 0
        self.tick += 1
        cdef Node node = self._walk(self.scratch, n, &matched)
        return matched, node

    def insert(self, tokens) -> int:
        """Store ``tokens`` (page aligned), evicting through the policy when full; returns new tokens stored."""
        cdef Py_ssize_t n = self._load(tokens), pos = 0, new, free_tokens, need, j, e_old, ph, freed
        cdef Py_ssize_t cur = self.cursor, i
        cdef bint same
        cdef const int64_t[::1] expected
        if self.pol == POLICY_OPT:
            if cur >= self.n_future:
                raise ValueError("opt cache: insert beyond the end of the future trace it was given")
            expected = self.future.paths[cur]
            same = expected.shape[0] == n
            i = 0
            while same and i < n:
                same = expected[i] == self.scratch[i]
                i += 1
            if not same:
                raise ValueError(f"opt cache: insert #{cur} differs from the future trace's request #{cur}")
        self.tick += 1
        cdef Node e = self._walk(self.scratch, n, &pos)
        cdef Node leaf
        new = n - pos
        if self.pol == POLICY_OPT:
            self.cursor += 1
        if new == 0:
            if self.pol == POLICY_OPT and e.slot >= 0:
                e.hkey = -self._next_use(e)
                self._sift_up(e.slot)
                self._sift_down(e.slot)
            return 0
        free_tokens = (self.capacity - self.evictable - self.protected) // self.page * self.page
        if new > free_tokens:
            need = new - free_tokens
            self._lock(e)  # the request holds its matched path while room is made
            try:
                if self.pol == POLICY_RLT:
                    # the most recently accessed path is this request's (even when it matched
                    # nothing): a phase turning over during this insert keeps only it marked
                    self.last_touched = e
                    # Algorithm 1 marks new page i before evicting for it; the phase turns over after
                    # marking page j, so evictions for pages >= j belong to the next phase.
                    j = (self.capacity - self.marked + self.page - 1) // self.page - 1
                    e_old = min(need // self.page, max(0, j - free_tokens // self.page))
                    ph = self.phase
                    freed = self._evict_rlt(e_old * self.page)
                    if j < new // self.page and ph == self.phase:
                        self._new_phase()
                    # page draws free exactly what is asked; leaf draws may free more: count it
                    self._evict_rlt(need - max(freed, e_old * self.page))
                else:
                    self._evict(need)
            finally:
                self._unlock(e)
            free_tokens = (self.capacity - self.evictable - self.protected) // self.page * self.page
            new = min(new, free_tokens)
            if new <= 0:
                return 0
        leaf = Node()
        leaf.buf = <int64_t*>malloc(new * sizeof(int64_t))
        if leaf.buf == NULL:
            raise MemoryError()
        memcpy(leaf.buf, self.scratch + pos, new * sizeof(int64_t))
        leaf.length = new
        leaf.depth = pos
        leaf.parent = e
        leaf.owner = <void*>self
        leaf.node_id = self.next_id
        self.next_id += 1
        if self.pol == POLICY_OPT:
            leaf.fnode = self.future.node_at(cur, pos + new - 1)
        e.children[self._key(leaf.buf)] = leaf
        self._remove_leaf(e)
        self.evictable += new
        self._touch(leaf)
        self._add_leaf(leaf)
        return new

    cdef int _lock(self, Node node) except -1:
        cdef Node n = node
        while n is not self.root:
            if n.lock_ref == 0:
                self.evictable -= n.length
                self.protected += n.length
                self._remove_leaf(n)
            n.lock_ref += 1
            n = n.parent
        return 0

    cdef int _unlock(self, Node node) except -1:
        cdef Node n = node
        while n is not self.root:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable += n.length
                self.protected -= n.length
                if not n.children:
                    if self.pol == POLICY_OPT:
                        n.fnode = _fnode_up(n.fnode, n.depth + n.length - 1)
                    self._add_leaf(n)
            n = n.parent
        return 0

    cdef int _check_node(self, object node, str what) except -1:
        if not isinstance(node, Node):
            raise TypeError(f"{what}: expected a Node from match_prefix, got {type(node).__name__}")
        cdef Node n = <Node>node
        if n.owner != <void*>self:
            raise ValueError(f"{what}: the node belongs to another cache")
        if n.removed:
            raise ValueError(f"{what}: the node was evicted from the cache")
        return 0

    def lock(self, node) -> None:
        """Reference-count +1 on ``node`` and its ancestors: their tokens become protected."""
        self._check_node(node, "lock")
        self._lock(<Node>node)

    def unlock(self, node) -> None:
        """Undo one ``lock(node)``."""
        self._check_node(node, "unlock")
        cdef Node n = <Node>node
        if n is not self.root and n.lock_ref <= 0:
            raise ValueError("unlock: the node is not locked")
        self._unlock(n)

    def evict(self, n_tokens) -> int:
        """Free at least ``n_tokens`` tokens from unlocked leaves if possible; returns tokens freed.

        rlt and opt free whole pages (so up to page_size - 1 more than asked); lru and rlt-leaf free
        whole leaf nodes, as SGLang does, so they may free more.
        """
        if type(n_tokens) is not int:  # fast path first: isinstance against an ABC is slow
            if isinstance(n_tokens, bool) or not isinstance(n_tokens, Integral):
                raise TypeError(f"evict: n_tokens must be an int, got {type(n_tokens).__name__}")
            n_tokens = int(n_tokens)
        if n_tokens < 0:
            raise ValueError(f"evict: n_tokens must be >= 0, got {n_tokens}")
        cdef Py_ssize_t want = self.capacity + self.page
        if n_tokens < want:
            want = n_tokens
        if self.pol == POLICY_LRU or self.leaf_draws:
            return self._evict(want)
        return self._evict((want + self.page - 1) // self.page * self.page)

    # ------------------------------------------------------------------ introspection (tests, benches)
    def _peek(self, tokens) -> int:
        """Longest cached prefix of ``tokens`` without touching or splitting anything."""
        cdef Py_ssize_t n = self._load(tokens), pos = 0, m, lim
        cdef Node node = self.root, child
        cdef PyObject* found
        while pos < n:
            found = PyDict_GetItem(node.children, self._key(self.scratch + pos))
            if found == NULL:
                break
            child = <Node>found
            lim = min(child.length, n - pos)
            m = 0
            while m < lim and child.buf[child.off + m] == self.scratch[pos + m]:
                m += 1
            pos += m // self.page * self.page
            if m < child.length:
                break
            node = child
        return pos

    def _nodes(self) -> list:
        """Every node as ``(node_id, depth, length, lock_ref, is_leaf, marked)`` (rlt marks)."""
        out = []
        stack = [self.root]
        cdef Node n
        while stack:
            n = stack.pop()
            if n is not self.root:
                out.append((n.node_id, n.depth, n.length, n.lock_ref, not n.children,
                            self.pol == POLICY_RLT and n.phase == self.phase))
            stack.extend(n.children.values())
        return out

    def _token_marks(self) -> dict:
        """Every cached token as ``{prefix tuple ending at it: marked}`` (tests, small trees only)."""
        out = {}
        stack = [(self.root, ())]
        cdef Node n
        cdef Py_ssize_t i
        while stack:
            node, prefix = stack.pop()
            n = <Node>node
            for i in range(n.length):
                prefix = prefix + (n.buf[n.off + i],)
                out[prefix] = self.pol == POLICY_RLT and n.phase == self.phase
            for c in n.children.values():
                stack.append((c, prefix))
        return out

    @property
    def marked_tokens(self) -> int:
        """rlt: distinct tokens marked in the current phase."""
        return self.marked

    @property
    def n_candidates(self) -> int:
        """Unlocked leaves (rlt: unmarked unlocked leaves)."""
        return self.n_unmarked if self.pol == POLICY_RLT else self.n_arr

    def _debug_check(self) -> None:
        """Recompute every invariant from scratch; raises AssertionError on the first violation."""
        cdef Node n, c
        cdef Py_ssize_t ev = 0, pr = 0, mk = 0, leaves = 0, i, locks
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                assert not n.removed
                assert n.length > 0 and n.length % self.page == 0, "node length"
                assert n.depth == n.parent.depth + n.parent.length, "depth"
                locks = 0
                for c in n.children.values():
                    locks += c.lock_ref
                assert n.lock_ref >= locks, "lock_ref below children's"
                if n.lock_ref:
                    pr += n.length
                else:
                    ev += n.length
                if self.pol == POLICY_RLT and n.phase == self.phase:
                    mk += n.length
                    assert n.parent is self.root or n.parent.phase == self.phase, "marked ancestor"
                if not n.children and n.lock_ref == 0:
                    leaves += 1
                    assert n.slot >= 0 and <Node>self.arr[n.slot] is n, "leaf not a candidate"
                    if self.pol == POLICY_RLT:
                        assert (n.slot < self.n_unmarked) == (n.phase != self.phase), "partition"
                    if self.pol == POLICY_OPT:
                        assert n.fnode.start <= n.depth + n.length - 1 < n.fnode.end, "fnode"
                else:
                    assert n.slot == -1, "non-leaf candidate"
            for c in n.children.values():
                assert c.parent is n
                assert self._key(c.buf + c.off) in n.children
                stack.append(c)
        assert ev == self.evictable, f"evictable {self.evictable} != {ev}"
        assert pr == self.protected, f"protected {self.protected} != {pr}"
        assert ev + pr <= self.capacity, "over capacity"
        assert leaves == self.n_arr, "candidate count"
        if self.pol == POLICY_RLT:
            assert mk == self.marked, f"marked {self.marked} != {mk}"
        elif self.n_arr:
            for i in range(1, self.n_arr):
                assert not _heap_less(<Node>self.arr[i], <Node>self.arr[(i - 1) >> 1]), "heap order"
