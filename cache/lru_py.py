"""``LruPyCache``: a pure-Python token radix tree with leaf-LRU eviction, written the way SGLang's
Python ``RadixCache`` is (list keys, dict children, a Python key-match loop, and an ``evict`` that
collects every leaf and heapifies them on each call). It is the speed reference ``lru-py`` of
``kvroute bench evict``; it makes the same decisions as ``RadixCache(policy="lru")`` (same logical
clock, same tie-break by node id), which the tests check.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from numbers import Integral

from kvroute.cache._checks import check_int, check_seed


class PyNode:
    """One radix-tree node; ``key`` is its run of token ids."""

    __slots__ = ("children", "parent", "key", "lock_ref", "last_access", "node_id", "evicted")

    def __init__(self, node_id: int, key: list[int], parent: PyNode | None, last_access: int) -> None:
        self.children: dict[object, PyNode] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id
        self.evicted = False

    def __lt__(self, other: PyNode) -> bool:
        return (self.last_access, self.node_id) < (other.last_access, other.node_id)


class LruPyCache:
    """Same public surface as ``RadixCache`` with ``policy == "lru"``."""

    policy = "lru-py"

    def __init__(self, capacity_tokens: int, page_size: int = 1, seed: int | None = None) -> None:
        self.capacity_tokens = check_int("capacity_tokens", capacity_tokens, 0)
        self.page_size = check_int("page_size", page_size, 1)
        check_seed(seed)  # accepted for a uniform constructor; LRU draws nothing at random
        self.root = PyNode(0, [], None, 0)
        self.evictable_size = 0
        self.protected_size = 0
        self._tick = 0
        self._next_id = 1

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # -- helpers ---------------------------------------------------------------------------------
    def _tokens(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        out = list(tokens)
        for pos, tok in enumerate(out):
            if not isinstance(tok, Integral) or isinstance(tok, bool):
                raise TypeError(f"token ids must be ints, got {type(tok).__name__} at position {pos}")
            if tok < 0:
                raise ValueError(f"token ids must be >= 0, got {tok} at position {pos}")
        return out[: len(out) // self.page_size * self.page_size]

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _key_match(self, key0: list[int], key1: list[int]) -> int:
        i = 0
        for k0, k1 in zip(key0, key1, strict=False):
            if k0 != k1:
                break
            i += 1
        return i // self.page_size * self.page_size

    def _split(self, child: PyNode, m: int) -> PyNode:
        new = PyNode(self._next_id, child.key[:m], child.parent, child.last_access)
        self._next_id += 1
        new.lock_ref = child.lock_ref
        assert child.parent is not None
        child.parent.children[self._child_key(child.key)] = new
        child.key = child.key[m:]
        child.parent = new
        new.children[self._child_key(child.key)] = child
        return new

    def _walk(self, key: list[int]) -> tuple[PyNode, int]:
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            m = self._key_match(child.key, key[pos:])
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self._tick
            node, pos = child, pos + m
        return node, pos

    # -- public API ------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[int, PyNode]:
        key = self._tokens(tokens)
        self._tick += 1
        node, pos = self._walk(key)
        return pos, node

    def insert(self, tokens: Sequence[int]) -> int:
        key = self._tokens(tokens)
        self._tick += 1
        node, pos = self._walk(key)
        new = len(key) - pos
        if new == 0:
            return 0
        free = (self.capacity_tokens - self.total_size) // self.page_size * self.page_size
        if new > free:
            self._lock(node)
            try:
                self.evict(new - free)
            finally:
                self._unlock(node)
            free = (self.capacity_tokens - self.total_size) // self.page_size * self.page_size
            new = min(new, free)
            if new <= 0:
                return 0
        leaf = PyNode(self._next_id, key[pos : pos + new], node, self._tick)
        self._next_id += 1
        node.children[self._child_key(leaf.key)] = leaf
        self.evictable_size += new
        return new

    def evict(self, n_tokens: int) -> int:
        if not isinstance(n_tokens, Integral) or isinstance(n_tokens, bool):
            raise TypeError(f"evict: n_tokens must be an int, got {type(n_tokens).__name__}")
        if n_tokens < 0:
            raise ValueError(f"evict: n_tokens must be >= 0, got {n_tokens}")
        leaves = self._collect_leaves()
        heapq.heapify(leaves)
        freed = 0
        while freed < n_tokens and leaves:
            x = heapq.heappop(leaves)
            if x.lock_ref > 0:
                continue
            freed += len(x.key)
            self.evictable_size -= len(x.key)
            parent = x.parent
            assert parent is not None
            del parent.children[self._child_key(x.key)]
            x.evicted = True
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _peek(self, tokens: Sequence[int]) -> int:
        """Longest cached prefix without touching or splitting anything (tests)."""
        key = self._tokens(tokens)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            m = self._key_match(child.key, key[pos:])
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    def _collect_leaves(self) -> list[PyNode]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def _check_node(self, node: object, what: str) -> PyNode:
        if not isinstance(node, PyNode):
            raise TypeError(f"{what}: expected a node from match_prefix, got {type(node).__name__}")
        if node.evicted:
            raise ValueError(f"{what}: the node was evicted from the cache")
        return node

    def _lock(self, node: PyNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def _unlock(self, node: PyNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def lock(self, node: PyNode) -> None:
        self._lock(self._check_node(node, "lock"))

    def unlock(self, node: PyNode) -> None:
        n = self._check_node(node, "unlock")
        if n is not self.root and n.lock_ref <= 0:
            raise ValueError("unlock: the node is not locked")
        self._unlock(n)
