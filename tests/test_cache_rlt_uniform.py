"""RLT's draws are uniform over the unmarked unlocked leaves (chi-square, fixed seeds)."""

from __future__ import annotations

import pytest
from kvroute.cache import RadixCache
from scipy.stats import chisquare


@pytest.mark.parametrize(("seed", "page"), [(0, 1), (12345, 1), (7, 4)])
def test_rlt_draws_are_uniform_over_candidate_leaves(seed: int, page: int) -> None:
    leaves, length, draws_per_leaf = 24, 2_000, 60
    cache = RadixCache(1_000_000, page_size=page, policy="rlt", seed=seed)
    cache.insert([7] * 64)  # a shared parent: candidates are its children plus nothing else
    for i in range(leaves):
        cache.insert([7] * 64 + [1000 + i] + [i] * (length - 1))
    # everything is marked (fewer than capacity tokens were touched): the first draw starts a new
    # phase that keeps only the last accessed path marked, so the first 23 leaves are the candidates
    candidates = leaves - 1
    n_draws = candidates * draws_per_leaf
    assert cache.evict(n_draws * page) == n_draws * page
    assert cache.phases == 1
    lengths = [cache._peek([7] * 64 + [1000 + i] + [i] * (length - 1)) - 64 for i in range(leaves)]
    taken = [(length // page * page - n) // page for n in lengths]
    assert taken[-1] == 0  # the marked (most recently accessed) leaf was never drawn
    assert sum(taken) == n_draws
    stat, p_value = chisquare(taken[:-1])
    assert p_value > 0.001, (taken, stat)
