"""RLT bookkeeping shared by both SGLang trees: phases, marks, the candidate array and the page draws.

Pure policy code: no SGLang import, no I/O, no clock. The SGLang adapters (``radix.py``, ``unified.py``)
feed it tree events and apply the victims it picks.

RLT (seed 004, Algorithm 1; DESIGN.md §2):
- every page a request touches is *marked* for the current phase; a node is marked iff
  ``node._rlt_phase == phase.number`` (so clearing all marks is ``phase.number += 1``, O(1));
- when the distinct marked tokens reach the capacity k, a new phase starts and only the path of the
  access that crossed k stays marked;
- to free space, draw an unmarked, unlocked leaf uniformly at random and evict its last page; repeat.
  Each leaf node holds one leaf page (its last), so a draw is uniform over candidate leaf *nodes*;
- no unmarked candidate left: a new phase starts (nothing marked) and the draws go on.

Invariant kept by the adapters: the marked nodes of a phase are closed under "parent of" (an access
marks its whole root path, a split copies the child's mark to the new parent), so marking a path can
stop at the first node already marked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from kvroute.cython_ext.page_draws import PageDraws

UNMARKED = -1  # phase number of a node never marked


class RLTPhase:
    """Phase counter and the number of distinct tokens marked in the current phase."""

    __slots__ = ("capacity_tokens", "marked_tokens", "number", "phases_started")

    def __init__(self, capacity_tokens: int) -> None:
        if not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool):
            raise TypeError(f"capacity_tokens must be an int, got {type(capacity_tokens).__name__}")
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.number = 0
        self.marked_tokens = 0
        self.phases_started = 0

    def start_new(self) -> None:
        """Clear every mark in O(1)."""
        self.number += 1
        self.marked_tokens = 0
        self.phases_started += 1


class RLTLeafSet(set):
    """The tree's evictable-leaf set, plus an indexed array of the same nodes split in two runs.

    ``_nodes[:_unmarked]`` are the unmarked leaves (the RLT candidates), ``_nodes[_unmarked:]`` the
    marked ones; each node stores its index in ``_rlt_pos``. Add, remove, mark and draw are O(1)
    (swap-remove); a new phase makes every leaf a candidate by moving the boundary. The set contents
    stay exactly SGLang's (this *is* a set), so SGLang's own membership tests and sanity checks work.
    """

    def __init__(self, phase: RLTPhase, nodes: Iterable[Any] = ()) -> None:
        super().__init__()
        self._phase = phase
        self._nodes: list[Any] = []
        self._unmarked = 0
        for node in nodes:
            self.add(node)

    # -- set mutators SGLang uses ------------------------------------------------------------------
    def add(self, node: Any) -> None:
        if set.__contains__(self, node):
            return
        set.add(self, node)
        nodes = self._nodes
        node._rlt_pos = len(nodes)
        nodes.append(node)
        if getattr(node, "_rlt_phase", UNMARKED) != self._phase.number:
            self._swap(node._rlt_pos, self._unmarked)
            self._unmarked += 1

    def discard(self, node: Any) -> None:
        if set.__contains__(self, node):
            self._remove(node)

    def remove(self, node: Any) -> None:
        if not set.__contains__(self, node):
            raise KeyError(node)
        self._remove(node)

    def clear(self) -> None:
        set.clear(self)
        self._nodes.clear()
        self._unmarked = 0

    def pop(self) -> Any:
        if not self._nodes:
            raise KeyError("pop from an empty set")
        node = self._nodes[-1]
        self._remove(node)
        return node

    def update(self, *others: Iterable[Any]) -> None:
        for other in others:
            for node in other:
                self.add(node)

    def difference_update(self, *others: Iterable[Any]) -> None:
        for other in others:
            for node in list(other):
                self.discard(node)

    def _unsupported(self, *_: Any, **__: Any) -> None:
        raise TypeError("RLTLeafSet supports add/discard/remove/clear/pop/update/difference_update only")

    __ior__ = __iand__ = __isub__ = __ixor__ = _unsupported  # type: ignore[assignment]
    intersection_update = symmetric_difference_update = _unsupported  # type: ignore[assignment]

    # -- RLT -------------------------------------------------------------------------------------------
    @property
    def unmarked_count(self) -> int:
        return self._unmarked

    def unmarked(self) -> list[Any]:
        """The current candidates (a copy)."""
        return self._nodes[: self._unmarked]

    def on_marked(self, node: Any) -> None:
        """``node`` was just marked: if it is an unmarked leaf here, move it to the marked run."""
        pos = getattr(node, "_rlt_pos", -1)
        if pos < 0 or pos >= self._unmarked or not set.__contains__(self, node):
            return
        self._unmarked -= 1
        self._swap(pos, self._unmarked)

    def on_new_phase(self) -> None:
        """Every leaf is unmarked now."""
        self._unmarked = len(self._nodes)

    def iter_nodes(self) -> Iterator[Any]:
        return iter(self._nodes)

    def check(self) -> None:
        """Raise AssertionError unless the array, the set, the positions and the marks agree."""
        nodes = self._nodes
        assert len(nodes) == set.__len__(self), "array and set sizes differ"
        assert 0 <= self._unmarked <= len(nodes)
        for i, node in enumerate(nodes):
            assert set.__contains__(self, node), "array holds a node outside the set"
            assert node._rlt_pos == i, "stale position"
            marked = getattr(node, "_rlt_phase", UNMARKED) == self._phase.number
            assert marked == (i >= self._unmarked), "node in the wrong run"

    # -- internals -------------------------------------------------------------------------------------
    def _swap(self, i: int, j: int) -> None:
        if i == j:
            return
        nodes = self._nodes
        a, b = nodes[i], nodes[j]
        nodes[i], nodes[j] = b, a
        a._rlt_pos, b._rlt_pos = j, i

    def _remove(self, node: Any) -> None:
        set.discard(self, node)
        pos = node._rlt_pos
        if pos < self._unmarked:  # keep the unmarked run contiguous
            self._unmarked -= 1
            self._swap(pos, self._unmarked)
            pos = self._unmarked
        last = len(self._nodes) - 1
        self._swap(pos, last)
        self._nodes.pop()
        node._rlt_pos = -1


def mark_path(node: Any, root: Any, phase: RLTPhase, leaves: RLTLeafSet) -> None:
    """Mark ``node`` and its ancestors (stopping at the first already marked one); may start a phase.

    Called once per access with the deepest node the access touched. When the distinct marked tokens
    reach k, a new phase starts and this access's path is re-marked (the most recent access stays
    marked, DESIGN.md §2).
    """
    number = phase.number
    cur = node
    while cur is not None and cur is not root:
        if getattr(cur, "_rlt_phase", UNMARKED) == number:
            break
        cur._rlt_phase = number
        phase.marked_tokens += len(cur.key)
        leaves.on_marked(cur)
        cur = cur.parent
    if phase.marked_tokens >= phase.capacity_tokens:
        phase.start_new()
        leaves.on_new_phase()
        number = phase.number
        cur = node
        while cur is not None and cur is not root:
            cur._rlt_phase = number
            phase.marked_tokens += len(cur.key)
            leaves.on_marked(cur)
            cur = cur.parent


def cut_key_tail(node: Any, keep: int, page_size: int) -> None:
    """Cut an SGLang node's key and page hashes after its first ``keep`` tokens (a page multiple), for
    an RLT trim of a leaf's tail; the caller cuts the KV slots, which both trees keep differently."""
    node.key = key_head(node.key, keep)
    pages = keep // page_size
    if node.hash_value is not None:
        node.hash_value = node.hash_value[:pages]
    if node.event_hash_value is not None:
        node.event_hash_value = node.event_hash_value[:pages]


def key_head(key: Any, n: int) -> Any:
    """``key[:n]`` for an SGLang ``RadixKey``, without ``__getitem__``'s generic slice handling for the
    plain case (no bigram view, no limit) — one call per leaf an RLT eviction trims."""
    if (
        _PLAIN_KEY_SLOTS
        and type(key).__slots__ == _PLAIN_KEY_SLOTS
        and not key.is_bigram
        and key.limit is None
    ):
        return type(key)(key.token_ids[:n], key.extra_key, cache_salt=key.cache_salt)
    return key[:n]


# The RadixKey fields (SGLang 0.5.x) that key_head copies; any other layout takes key[:n].
_PLAIN_KEY_SLOTS = ("token_ids", "extra_key", "cache_salt", "is_bigram", "limit")


def draw_leaf(leaves: RLTLeafSet, phase: RLTPhase, randbelow: Callable[[int], int]) -> Any | None:
    """A uniformly random unmarked leaf (starting a new phase when none is left), or None when the tree
    has no evictable leaf at all. ``randbelow(n)`` is uniform on ``range(n)``. For ``unit="leaf"``."""
    n = leaves._unmarked
    if n == 0:
        if not leaves._nodes:
            return None
        phase.start_new()  # no unmarked leaf left: new phase, every leaf is a candidate
        leaves.on_new_phase()
        n = leaves._unmarked
    return leaves._nodes[randbelow(n)]


def draw_pages(draws: PageDraws, room: np.ndarray, quota: int) -> tuple[np.ndarray, int, int]:
    """RLT's one-page draws over fixed candidates until ``quota`` draws or one is emptied.

    ``room[i]`` >= 1 is how many pages candidate i still has. Each draw picks a candidate uniformly
    and takes one page from it; the run stops after ``quota`` draws or right after the draw that takes
    a candidate's last page (it leaves the candidate set, its parent may join it: the caller applies
    that before drawing again). The draws are made one at a time in C (``PageDraws``).

    Returns ``(taken, n_draws, emptied)``: pages taken per candidate, draws made, and the index of the
    emptied candidate or -1.
    """
    room = np.ascontiguousarray(room, dtype=np.int64)
    taken = np.zeros(room.shape[0], dtype=np.int64)
    n_draws, emptied = draws.draw(room, quota, taken)
    return taken, n_draws, emptied
