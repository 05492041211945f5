# Shared by the Cython modules that draw uniformly at random (textual include: `include "rng.pxi"`).
# One seeded splitmix64 stream per structure; bounded draws are exact-uniform (Lemire's multiply and
# reject) on 16-bit chunks of an output while the bound is at most 2**16 (four draws per output), else
# on its top 32 bits. Needs `from libc.stdint cimport int64_t, uint64_t` in the including module.

cdef struct Rng:
    uint64_t state     # splitmix64
    uint64_t bits      # unused 16-bit chunks of the last output
    int nchunks


cdef inline uint64_t _splitmix64(uint64_t* state) noexcept nogil:
    state[0] += <uint64_t>0x9E3779B97F4A7C15ULL
    cdef uint64_t z = state[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline void _rng_seed(Rng* r, uint64_t seed) noexcept nogil:
    r.state = _splitmix64(&seed)  # any state is fine for splitmix64
    r.bits = 0
    r.nchunks = 0


cdef inline uint64_t _reject_below(uint64_t bound) noexcept nogil:
    """Lemire's rejection threshold for draws in [0, bound), 1 <= bound <= 2**32."""
    if bound <= 0x10000:
        return (0x10000ULL - bound) % bound
    return (0x100000000ULL - bound) % bound


cdef inline Py_ssize_t _try_below(Rng* r, uint64_t bound, uint64_t thresh) noexcept nogil:
    """One attempt at an exact-uniform draw in [0, bound): the index, or -1 when the attempt is
    rejected (try again). ``thresh`` is ``_reject_below(bound)``."""
    cdef uint64_t x, m
    if bound <= 0x10000:  # four 16-bit draws per 64-bit output
        if r.nchunks == 0:
            r.bits = _splitmix64(&r.state)
            r.nchunks = 4
        x = r.bits & 0xFFFFULL
        r.bits >>= 16
        r.nchunks -= 1
        m = x * bound
        if (m & 0xFFFFULL) < thresh:
            return -1
        return <Py_ssize_t>(m >> 16)
    x = _splitmix64(&r.state) >> 32
    m = x * bound
    if (m & 0xFFFFFFFFULL) < thresh:
        return -1
    return <Py_ssize_t>(m >> 32)


cdef inline Py_ssize_t _uniform_below(Rng* r, Py_ssize_t u) noexcept nogil:
    """One exact-uniform draw in [0, u), 1 <= u <= 2**32."""
    cdef uint64_t bound = <uint64_t>u, thresh = _reject_below(bound)
    cdef Py_ssize_t i = -1
    while i < 0:
        i = _try_below(r, bound, thresh)
    return i


cdef inline Py_ssize_t _count_draws_dense(Rng* r, Py_ssize_t u, const int64_t* rem, int64_t* cnt,
                                          Py_ssize_t todo, Py_ssize_t* emptied) noexcept nogil:
    """Draw up to ``todo`` uniform candidates in [0, u) one at a time, counting per candidate in
    ``cnt``; stop at the draw that takes a candidate's last page (``cnt[i] == rem[i]``; its index goes
    to ``emptied``, else -1). Returns the draws made. The hot case (u <= 2**16) keeps the generator in
    plain locals: ``cnt`` may alias the state's fields as far as C knows, which would otherwise force
    reloads after every count (measured ~6% slower per draw)."""
    cdef Py_ssize_t d = 0, i
    cdef uint64_t state = r.state, bits = r.bits, x, m, bound = <uint64_t>u
    cdef uint64_t thresh = _reject_below(bound)
    cdef int nchunks = r.nchunks
    cdef Rng g
    emptied[0] = -1
    if u > 0x10000:  # rare: one 32-bit draw per output, through the general attempt
        g = r[0]
        while d < todo:
            i = _try_below(&g, bound, thresh)
            if i < 0:
                continue
            cnt[i] += 1
            d += 1
            if cnt[i] == rem[i]:
                emptied[0] = i
                break
        r[0] = g
        return d
    while d < todo:
        if nchunks == 0:
            bits = _splitmix64(&state)
            nchunks = 4
        x = bits & 0xFFFFULL
        bits >>= 16
        nchunks -= 1
        m = x * bound
        if (m & 0xFFFFULL) < thresh:
            continue
        i = <Py_ssize_t>(m >> 16)
        cnt[i] += 1
        d += 1
        if cnt[i] == rem[i]:
            emptied[0] = i
            break
    r.state = state
    r.bits = bits
    r.nchunks = nchunks
    return d
