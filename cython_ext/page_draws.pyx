# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Sequential RLT page draws for the SGLang plugin (``engine_patches/sglang``), in C.

RLT frees space by drawing a uniformly random candidate leaf and taking one page from it, again and
again; a leaf whose last page is taken leaves the candidate set (its parent may join), so the caller
stops drawing at that point and updates the candidates. ``PageDraws.draw`` makes those draws over a
fixed candidate set one at a time — a few nanoseconds per draw — and stops after ``quota`` draws or
right after the draw that empties a candidate.

The generator is splitmix64 seeded from ``seed`` (or the OS when None); a bounded draw is exactly
uniform (Lemire's multiply-and-reject on 16-bit chunks while there are at most 2**16 candidates, on
32-bit ones beyond). No I/O, no clock.
"""

import os

from libc.stdint cimport int64_t, uint64_t


include "rng.pxi"


cdef class PageDraws:
    """A seeded stream of RLT page draws. ``seed``: a non-negative int, or None for OS entropy."""

    cdef Rng rng
    cdef readonly object seed

    def __init__(self, seed=None):
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        self.seed = seed
        _rng_seed(&self.rng, int.from_bytes(os.urandom(8), "little") if seed is None
                  else (<uint64_t>(seed & 0xFFFFFFFFFFFFFFFF)))

    def draw(self, const int64_t[::1] room not None, Py_ssize_t quota, int64_t[::1] taken not None):
        """Draw up to ``quota`` pages uniformly over the ``len(room)`` candidates, one at a time.

        ``room[i]`` >= 1 is how many pages candidate i has left; ``taken[i]`` (same length, all zeros
        on entry) receives the pages drawn from it. Returns ``(draws, emptied)``: the draws made and
        the index of the candidate whose last page the final draw took, or -1 (then ``draws ==
        quota``, or 0 when there is no candidate or ``quota`` <= 0)."""
        cdef Py_ssize_t m = room.shape[0], d = 0, i
        if taken.shape[0] != m:
            raise ValueError(f"taken has {taken.shape[0]} entries, room {m}")
        if m == 0 or quota <= 0:
            return 0, -1
        for i in range(m):
            if room[i] < 1:
                raise ValueError(f"room[{i}] = {room[i]}: every candidate has at least one page")
        cdef Py_ssize_t emptied = -1
        if m > 0x100000000:
            raise ValueError(f"at most 2**32 candidates, got {m}")
        with nogil:
            d = _count_draws_dense(&self.rng, m, &room[0], &taken[0], quota, &emptied)
        return d, emptied
