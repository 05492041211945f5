"""A word-level tokenizer for the simulator: one token = one whitespace-separated word.

Why: the router's prefix index works on characters and the engines' caches on tokens. Workloads are
generated as token ids (``range(32000)``) so that the cache core and the simulator can replay them
exactly; this module turns any such trace into text the router can see, and text back into the same ids.

Invariants:
- ids ``0 .. VOCAB_SIZE-1`` map to a fixed vocabulary of distinct pseudo-words (lower-case letters only),
  built from a hash, so it is identical in every process and every Python version;
- ``encode(decode(ids)) == ids`` for every list of non-negative ints;
- a word outside the vocabulary gets a stable id ``>= VOCAB_SIZE`` (a hash of the word); ``decode`` writes
  such an id as ``~<id>``, which ``encode`` reads back as the same id;
- ``decode(encode(text)) == " ".join(text.split())`` for text made of vocabulary words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from operator import itemgetter

VOCAB_SIZE = 32000
UNKNOWN_ID_LIMIT = 2**31  # ids of unknown words lie in [VOCAB_SIZE, UNKNOWN_ID_LIMIT)

_CONSONANTS = "bdfghjklmnprstvwz"
_VOWELS = "aeiou"
_CODAS = "nrst"
# 85 open syllables (CV) and 340 closed ones (CVC); words have 1-3 syllables, so word lengths vary
# (2-9 letters) the way real sub-word tokens vary in characters.
_SYLLABLES: tuple[str, ...] = tuple(
    [c + v for c in _CONSONANTS for v in _VOWELS]
    + [c + v + k for c in _CONSONANTS for v in _VOWELS for k in _CODAS]
)


def _build_vocabulary() -> tuple[list[str], dict[str, int]]:
    words: list[str] = []
    index: dict[str, int] = {}
    n_syl = len(_SYLLABLES)
    for token_id in range(VOCAB_SIZE):
        attempt = 0
        while True:
            digest = hashlib.blake2b(f"{token_id}:{attempt}".encode(), digest_size=16).digest()
            count = (1, 2, 2, 3)[digest[0] % 4]
            word = "".join(
                _SYLLABLES[int.from_bytes(digest[1 + 2 * i : 3 + 2 * i], "little") % n_syl]
                for i in range(count)
            )
            if word not in index:
                break
            attempt += 1
        index[word] = token_id
        words.append(word)
    return words, index


_WORDS, _INDEX = _build_vocabulary()


def vocabulary() -> list[str]:
    """A copy of the fixed vocabulary, indexed by token id."""
    return list(_WORDS)


def word_id(word: str) -> int:
    """The id of one word: its vocabulary id, the id written as ``~<id>``, or a stable hash id."""
    known = _INDEX.get(word)
    if known is not None:
        return known
    if len(word) > 1 and word[0] == "~" and word[1:].isdigit():
        value = int(word[1:])
        if VOCAB_SIZE <= value < UNKNOWN_ID_LIMIT:
            return value
    digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return VOCAB_SIZE + int.from_bytes(digest, "little") % (UNKNOWN_ID_LIMIT - VOCAB_SIZE)


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word."""
    if not isinstance(text, str):
        raise TypeError(f"encode() needs a str, got {type(text).__name__}")
    index = _INDEX
    out: list[int] = []
    for word in text.split():
        known = index.get(word)
        out.append(known if known is not None else word_id(word))
    return out


def decode(ids: Iterable[int]) -> str:
    """Text of token ids, words joined by single spaces."""
    words = _WORDS
    ids = ids if isinstance(ids, (list, tuple)) else list(ids)
    if len(ids) > 1:
        # fast path, C loops only: vocabulary ids (itemgetter raises for ids past the end or non-ints;
        # the min() check stops negative ids from wrapping around)
        try:
            if min(ids) >= 0:
                return " ".join(itemgetter(*ids)(words))
        except (IndexError, TypeError):
            pass  # the checked loop below says exactly what is wrong, or writes unknown ids
    parts: list[str] = []
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise TypeError(f"token ids must be ints, got {type(token_id).__name__}")
        if 0 <= token_id < VOCAB_SIZE:
            parts.append(words[token_id])
        elif VOCAB_SIZE <= token_id < UNKNOWN_ID_LIMIT:
            parts.append(f"~{token_id}")
        else:
            raise ValueError(f"token id {token_id} is outside [0, {UNKNOWN_ID_LIMIT})")
    return " ".join(parts)


def count_tokens(text: str) -> int:
    """Number of tokens ``encode(text)`` would return, without building the list."""
    return len(text.split())


def text_chars(ids: Sequence[int]) -> int:
    """Length in characters of ``decode(ids)``."""
    return len(decode(ids))


def simulated_output(req_id: str, n_tokens: int) -> list[int]:
    """The ``n_tokens`` output tokens the simulated model generates for request ``req_id``.

    Deterministic in the request id (so a multi-turn workload can put a reply into the next turn's
    history, as a real client does with the text it received), vocabulary ids only.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    out: list[int] = []
    counter = 0
    while len(out) < n_tokens:
        digest = hashlib.blake2b(f"{req_id}#{counter}".encode(), digest_size=32).digest()
        for i in range(0, 32, 4):
            if len(out) == n_tokens:
                break
            out.append(int.from_bytes(digest[i : i + 4], "little") % VOCAB_SIZE)
        counter += 1
    return out
