"""``prefix_hash``: consistent hashing of the prompt prefix with bounded loads.

The first ``prefix_chars`` characters of the text are hashed (BLAKE2b, stable across processes) onto a
ring with ``virtual_nodes`` points per worker. Consistent hashing with bounded loads (Mirrokni,
Thorup & Zadimoghaddam, SODA 2018): a worker may take the request only while its in-flight count is
below ceil(``balance_factor`` x (total in-flight + 1) / N); otherwise the walk continues clockwise to
the next worker. Defaults: 256-character prefix (sglang-router's ``prefix_hash`` hashes a fixed-size
prefix; characters stand in for its tokens), 160 virtual nodes, balance factor 1.25.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from kvroute.router.types import Policy, Request, WorkerView


def _h64(data: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


class PrefixHashPolicy(Policy):
    name = "prefix_hash"

    def __init__(
        self, prefix_chars: int = 256, virtual_nodes: int = 160, balance_factor: float = 1.25
    ) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_hash: prefix_chars must be >= 1, got {prefix_chars}")
        if virtual_nodes < 1:
            raise ValueError(f"prefix_hash: virtual_nodes must be >= 1, got {virtual_nodes}")
        if not balance_factor >= 1.0:
            raise ValueError(f"prefix_hash: balance_factor must be >= 1.0, got {balance_factor}")
        self.prefix_chars = int(prefix_chars)
        self.virtual_nodes = int(virtual_nodes)
        self.balance_factor = float(balance_factor)
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()

    def _rebuild(self) -> None:
        ring = sorted((_h64(f"{w}#{i}"), w) for w in self._members for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def on_worker_added(self, worker_id: str) -> None:
        self._members.add(worker_id)
        self._rebuild()

    def on_worker_removed(self, worker_id: str) -> None:
        self._members.discard(worker_id)
        self._rebuild()

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        by_id = {v.id: v for v in workers}
        if any(w not in self._members for w in by_id):  # policy used without Router membership calls
            self._members.update(by_id)
            self._rebuild()
        total = sum(v.in_flight for v in workers)
        cap = math.ceil(self.balance_factor * (total + 1) / len(workers))
        start = bisect.bisect_left(self._points, _h64(request.text[: self.prefix_chars]))
        n = len(self._points)
        seen: set[str] = set()
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if owner in seen:
                continue
            seen.add(owner)
            view = by_id.get(owner)
            if view is not None and view.in_flight < cap:
                return owner
            if len(seen) == len(self._members):
                break
        # every eligible worker is at its bound (cannot happen since cap > mean); least loaded then
        return min(workers, key=lambda v: v.in_flight).id
