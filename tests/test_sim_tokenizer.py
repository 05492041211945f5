"""kvroute.sim.tokenizer: one token per word, a fixed vocabulary, stable across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.sim import tokenizer as tok


def test_vocabulary_is_32000_distinct_letter_words() -> None:
    words = tok.vocabulary()
    assert len(words) == tok.VOCAB_SIZE == 32000
    assert len(set(words)) == 32000
    assert all(w.isalpha() and w.islower() for w in words)
    lengths = {len(w) for w in words}
    assert min(lengths) >= 2 and max(lengths) <= 9 and len(lengths) > 4  # lengths vary like real tokens


def test_same_ids_in_a_fresh_process() -> None:
    code = (
        "from kvroute.sim import tokenizer as t;"
        "print(t.encode('hello ' + t.decode([0, 1, 31999])), t.simulated_output('r1', 3))"
    )
    here = f"{tok.encode('hello ' + tok.decode([0, 1, 31999]))} {tok.simulated_output('r1', 3)}"
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=tok.UNKNOWN_ID_LIMIT - 1), max_size=50))
def test_encode_decode_round_trip(ids: list[int]) -> None:
    assert tok.encode(tok.decode(ids)) == ids


def test_text_of_vocabulary_words_round_trips_up_to_whitespace() -> None:
    words = tok.vocabulary()
    text = f"  {words[5]}\t{words[7]}\n\n{words[5]} "
    assert tok.encode(text) == [5, 7, 5]
    assert tok.decode(tok.encode(text)) == " ".join(text.split())
    assert tok.count_tokens(text) == 3


def test_unknown_words_get_stable_ids_above_the_vocabulary() -> None:
    ids = tok.encode("Hello, world! Hello,")
    assert ids[0] == ids[2] >= tok.VOCAB_SIZE
    assert ids[1] >= tok.VOCAB_SIZE and ids[1] != ids[0]
    assert tok.decode([ids[0]]) == f"~{ids[0]}"
    assert tok.encode(tok.decode(ids)) == ids


def test_bad_input_is_rejected() -> None:
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tok.decode([-1])
    with pytest.raises(ValueError):
        tok.decode([tok.UNKNOWN_ID_LIMIT])
    with pytest.raises(TypeError):
        tok.decode([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        tok.simulated_output("r", -1)


def test_simulated_output_is_deterministic_per_request() -> None:
    a = tok.simulated_output("req-a", 20)
    assert a == tok.simulated_output("req-a", 20)
    assert a[:5] == tok.simulated_output("req-a", 5)
    assert a != tok.simulated_output("req-b", 20)
    assert all(0 <= t < tok.VOCAB_SIZE for t in a)
