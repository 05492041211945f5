"""kvroute.cache: the token radix cache (``RadixCache``: lru / rlt / rlt-leaf / opt) and the pure-Python LRU
reference (``LruPyCache``, the speed baseline written the way SGLang's Python tree is)."""

from kvroute.cache.lru_py import LruPyCache
from kvroute.cache.radix_cache import Node, RadixCache

__all__ = ["LruPyCache", "Node", "RadixCache", "make_cache"]


def make_cache(policy: str, capacity_tokens: int, page_size: int = 1, seed: int | None = None):
    """``lru`` / ``rlt`` / ``rlt-leaf`` (Cython) or ``lru-py`` (pure Python); ``opt`` needs ``RadixCache.with_future``."""
    if policy == "lru-py":
        return LruPyCache(capacity_tokens, page_size=page_size)
    return RadixCache(capacity_tokens, page_size=page_size, policy=policy, seed=seed)
