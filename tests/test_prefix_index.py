"""PrefixIndex: match semantics against a brute-force model, LRU trimming, removal, real memory release."""

from __future__ import annotations

import gc
import os
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.router import PrefixIndex


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute_match(held: dict[str, set[str]], text: str) -> dict[str, int]:
    out = {}
    for worker, texts in held.items():
        best = max((common_prefix(t, text) for t in texts), default=0)
        if best > 0:
            out[worker] = best
    return out


def test_match_counts_partial_edges_per_worker() -> None:
    ix = PrefixIndex(1000)
    ix.insert("hello world", "a", 1.0)
    ix.insert("hello there", "b", 2.0)
    ix.insert("help", "a", 3.0)
    assert ix.match("hello world!") == {"a": 11, "b": 6}
    assert ix.match("help me") == {"a": 4, "b": 3}
    assert ix.match("hex") == {"a": 2, "b": 2}
    assert ix.match("xyz") == {}
    assert ix.match("") == {}
    assert ix.stored_chars == len("hello ") + len("world") + len("there") + len("p")
    assert ix.worker_chars("a") == len("hello world") + len("p")
    ix.check_invariants()


def test_unicode_text_of_mixed_widths_matches() -> None:
    ix = PrefixIndex(1000)
    ix.insert("naïve café ☕ order", "a", 1.0)  # UCS-2 text; its edges may be stored as latin-1 slices
    ix.insert("naïve tea", "b", 1.0)
    assert ix.match("naïve café ☕ order") == {"a": 18, "b": 6}
    assert ix.match("naïve café") == {"a": 10, "b": 6}
    ix.insert("plain ascii", "a", 2.0)
    assert ix.match("plain ascii ☕") == {"a": 11}
    ix.check_invariants()


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixIndex(0)
    ix = PrefixIndex(100)
    with pytest.raises(TypeError):
        ix.insert(b"bytes", "a", 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ix.match(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="worker id"):
        ix.insert("text", 7, 0.0)  # type: ignore[arg-type]


def test_more_than_256_workers_is_refused_and_slots_are_reused() -> None:
    ix = PrefixIndex(100_000)
    for i in range(256):
        ix.insert(f"p{i}", f"w{i}", 0.0)
    with pytest.raises(ValueError, match="256"):
        ix.insert("x", "one-too-many", 0.0)
    ix.remove_worker("w0")
    ix.insert("x", "one-too-many", 1.0)
    assert ix.match("x") == {"one-too-many": 1}
    ix.check_invariants()


def test_trimming_evicts_least_recently_used_first() -> None:
    a, b, c, d = ("A" * 100, "B" * 100, "C" * 100, "D" * 100)
    ix = PrefixIndex(300)
    ix.insert(a, "w", 1.0)
    ix.insert(b, "w", 2.0)
    ix.insert(c, "w", 3.0)
    ix.insert(a, "w", 4.0)  # touch A: B is now the least recently used
    ix.insert(d, "w", 5.0)
    assert ix.stored_chars == 300
    assert ix.match(b) == {}
    for kept in (a, c, d):
        assert ix.match(kept) == {"w": 100}
    ix.check_invariants()


def test_trimming_is_per_worker_and_frees_chars_only_when_nobody_holds_them() -> None:
    shared, other = "S" * 100, "O" * 100
    ix = PrefixIndex(200)
    ix.insert(shared, "old", 1.0)
    ix.insert(shared, "new", 5.0)
    ix.insert(other, "new", 6.0)
    assert ix.stored_chars == 200
    ix.insert("N" * 50, "new", 7.0)  # 250 > 200: "old"'s copy of S goes first, but frees nothing
    # then the next oldest (new's S at t=5) must go, which finally frees S's characters
    assert ix.stored_chars <= 200
    assert "old" not in ix.match(shared)
    assert ix.match(other) == {"new": 100}
    ix.check_invariants()


def test_leaf_first_trimming_keeps_the_shared_prefix() -> None:
    prefix = "P" * 60
    ix = PrefixIndex(120)
    ix.insert(prefix + "x" * 30, "w", 1.0)
    ix.insert(prefix + "y" * 30, "w", 2.0)
    ix.insert(prefix + "z" * 30, "w", 3.0)  # 150 > 120: the oldest leaf (x) goes, the prefix stays
    assert ix.stored_chars == 120
    assert ix.match(prefix + "x" * 30) == {"w": 60}
    assert ix.match(prefix + "z" * 30) == {"w": 90}
    ix.check_invariants()


def test_text_longer_than_max_chars_is_truncated() -> None:
    ix = PrefixIndex(10)
    assert ix.insert("abcdefghijklmnop", "w", 1.0) == 10
    assert ix.match("abcdefghijklmnop") == {"w": 10}
    ix.check_invariants()


def test_remove_worker_leaves_no_trace() -> None:
    rng = random.Random(3)
    mixed = PrefixIndex(1_000_000)
    alone = PrefixIndex(1_000_000)
    texts = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 30))) for _ in range(400)]
    for i, t in enumerate(texts):
        worker = "keep" if i % 3 else "gone"
        mixed.insert(t, worker, float(i))
        if worker == "keep":
            alone.insert(t, worker, float(i))
    held = mixed.worker_chars("gone")
    assert held > 0
    assert mixed.remove_worker("gone") == held
    mixed.check_invariants()
    assert mixed.worker_chars("gone") == 0
    assert "gone" not in mixed.workers
    assert mixed.stored_chars == alone.stored_chars
    assert mixed.worker_chars("keep") == alone.worker_chars("keep")
    assert mixed.node_count <= alone.node_count
    for t in texts:
        assert mixed.match(t) == alone.match(t)
    assert mixed.remove_worker("gone") == 0  # idempotent
    mixed.remove_worker("keep")
    assert mixed.stored_chars == 0 and mixed.node_count == 0
    mixed.check_invariants()


def test_removal_and_trimming_really_free_memory() -> None:
    rng = random.Random(5)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        ix = PrefixIndex(200_000)
        for i in range(3000):
            text = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(50, 400)))
            ix.insert(text, f"w{i % 5}", float(i))
        full, _ = tracemalloc.get_traced_memory()
        assert ix.stored_chars <= 200_000
        for w in [f"w{i}" for i in range(5)]:
            ix.remove_worker(w)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        assert full - base > 200_000  # the index did hold memory
        assert after - base < 50_000  # and gave (almost) all of it back: only the empty shell is left
        del ix
    finally:
        tracemalloc.stop()


def test_stays_within_max_chars_under_a_million_distinct_prompts() -> None:
    n = int(os.environ.get("KVROUTE_INDEX_STRESS_PROMPTS", "1000000"))
    rng = random.Random(11)
    ix = PrefixIndex(200_000)
    peak = 0
    for i in range(n):
        # distinct prompts: a few shared heads and a unique numbered tail
        ix.insert(f"system {i % 7}: user {rng.randrange(1 << 30)} asks #{i}", f"w{i % 8}", float(i))
        if ix.stored_chars > peak:
            peak = ix.stored_chars
    assert peak <= 200_000
    assert ix.stats()["heap_entries"] <= 2 * ix.node_count * 8 + 8192  # stale trim candidates stay bounded
    ix.check_invariants()


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["insert", "insert", "insert", "remove", "match"]))
        text = draw(st.text(alphabet="ab☕", min_size=0, max_size=12))
        worker = draw(st.sampled_from(["w0", "w1", "w2"]))
        ops.append((kind, text, worker))
    return ops


@settings(max_examples=150, deadline=None)
@given(operations())
def test_unbounded_index_matches_brute_force(ops: list[tuple[str, str, str]]) -> None:
    ix = PrefixIndex(10_000)
    held: dict[str, set[str]] = {}
    for step, (kind, text, worker) in enumerate(ops):
        if kind == "insert":
            ix.insert(text, worker, float(step))
            if text:
                held.setdefault(worker, set()).add(text)
        elif kind == "remove":
            ix.remove_worker(worker)
            held.pop(worker, None)
        else:
            assert ix.match(text) == brute_match(held, text)
    ix.check_invariants()
    for texts in held.values():
        for t in texts:
            assert ix.match(t) == brute_match(held, t)


@settings(max_examples=100, deadline=None)
@given(operations(), st.integers(1, 25))
def test_bounded_index_never_overclaims(ops: list[tuple[str, str, str]], max_chars: int) -> None:
    ix = PrefixIndex(max_chars)
    held: dict[str, set[str]] = {}
    for step, (kind, text, worker) in enumerate(ops):
        if kind == "insert":
            ix.insert(text, worker, float(step))
            if text:
                held.setdefault(worker, set()).add(text[:max_chars])
        elif kind == "remove":
            ix.remove_worker(worker)
            held.pop(worker, None)
        else:
            truth = brute_match(held, text)
            for w, n in ix.match(text).items():
                assert n <= truth.get(w, 0)  # trimming may forget, never invent
        assert ix.stored_chars <= max_chars
        ix.check_invariants()


def test_last_used_times_follow_inserts_along_the_path() -> None:
    ix = PrefixIndex(1000)
    ix.insert("abcdef", "w", 1.0)
    ix.insert("abcxyz", "w", 5.0)
    ix.insert("abc", "v", 7.0)
    assert ix.last_used("abcdef", "w") == 1.0
    assert ix.last_used("abcxyz", "w") == 5.0
    assert ix.last_used("abc", "w") == 5.0  # the shared prefix was used by the later insert
    assert ix.last_used("abc", "v") == 7.0
    assert ix.last_used("abcdef", "v") is None
    assert ix.last_used("ab", "w") == 5.0  # mid-edge: the node covering its last character
    assert ix.last_used("abc", "nobody") is None


def test_set_max_chars_trims_the_least_recently_used_now_and_rejects_bad_bounds() -> None:
    ix = PrefixIndex(10_000)
    for i in range(10):
        ix.insert(chr(97 + i) + "x" * 99, "w0", float(i))  # 10 unrelated 100-char prompts, oldest first
    assert ix.stored_chars == 1_000
    ix.set_max_chars(450)
    assert ix.max_chars == 450 and ix.stored_chars <= 450
    assert ix.match("j" + "x" * 99) == {"w0": 100}  # the newest prompts stay
    assert ix.match("a" + "x" * 99) == {}  # the oldest went first
    ix.check_invariants()
    ix.set_max_chars(10_000)  # growing drops nothing
    assert ix.max_chars == 10_000 and ix.match("j" + "x" * 99) == {"w0": 100}
    with pytest.raises(ValueError, match="max_chars"):
        ix.set_max_chars(0)
