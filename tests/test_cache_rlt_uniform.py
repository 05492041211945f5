"""RLT's draws (rlt: pages, rlt-leaf: whole leaves) are uniform over the unmarked unlocked leaves
(chi-square, fixed seeds)."""

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


def test_rlt_leaf_draws_are_uniform_over_candidate_leaves() -> None:
    """rlt-leaf: the first draw after the phase turns over picks each unmarked leaf equally often."""
    leaves, seeds = 13, 1300
    taken = [0] * leaves
    for seed in range(seeds):
        cache = RadixCache(1000, policy="rlt-leaf", seed=seed)
        for i in range(leaves):
            cache.insert([5, i, i])
        assert cache.evict(1) == 2  # one whole leaf [i, i] under the shared [5]
        gone = [i for i in range(leaves) if cache._peek([5, i, i]) == 1]
        assert len(gone) == 1
        taken[gone[0]] += 1
    assert taken[-1] == 0  # the most recently accessed leaf stays marked
    assert chisquare(taken[:-1]).pvalue > 0.001, taken


def test_rlt_leaf_draws_on_a_tree_over_65536_leaves_are_uniform() -> None:
    """Past 2**16 candidates a draw uses 32 random bits: the drawn leaves still spread evenly."""
    leaves, draws, bins = 70_001, 7_000, 10
    cache = RadixCache(10_000_000, policy="rlt-leaf", seed=4)
    for i in range(leaves):
        cache.insert([i])
    assert cache.evict(draws) == draws  # one-token leaves: one draw per token
    assert cache.phases == 1 and cache._peek([leaves - 1]) == 1
    per_bin = [0] * bins
    for i in range(leaves - 1):
        if cache._peek([i]) == 0:
            per_bin[i * bins // (leaves - 1)] += 1
    assert sum(per_bin) == draws
    assert chisquare(per_bin).pvalue > 0.001, per_bin
    cache._debug_check()
