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


def test_rlt_single_page_draws_on_a_wide_tree_are_uniform() -> None:
    """Few draws among many candidates take the sparse path (O(draws) per call): still uniform."""
    leaves, per_leaf = 400, 25
    cache = RadixCache(10_000_000, policy="rlt", seed=99)
    for i in range(leaves):
        cache.insert([i // 256, i % 256] + [7] * 98)
    candidates = leaves - 1  # the last inserted path stays marked after the first phase reset
    for _ in range(candidates * per_leaf):
        assert cache.evict(1) == 1
    assert cache.phases == 1
    taken = [100 - cache._peek([i // 256, i % 256] + [7] * 98) for i in range(leaves)]
    assert taken[-1] == 0 and sum(taken) == candidates * per_leaf
    assert chisquare(taken[:-1]).pvalue > 0.001
    cache._debug_check()
