"""Request parsing shared by the router and the sim worker: what routing sees, and clean 4xx errors."""

from __future__ import annotations

import pytest
from kvroute.router.health import normalize_worker_url
from kvroute.router.http_validate import RequestError, flatten_chat, parse_request


def test_completion_prompts_of_every_shape() -> None:
    p = parse_request(
        "completions", b'{"prompt": "hello there", "max_tokens": 7, "stream": true, "model": "m"}'
    )
    assert (p.index_text, p.prompt_text, p.prompt_ids, p.max_tokens, p.stream, p.model) == (
        "hello there",
        "hello there",
        None,
        7,
        True,
        "m",
    )
    ids = parse_request("completions", b'{"prompt": [5, 6, 7]}')
    assert ids.prompt_ids == [5, 6, 7] and ids.index_text == "5 6 7" and ids.max_tokens == 16
    nested = parse_request("completions", b'{"prompt": [[1, 2], [3]]}')
    assert nested.prompt_ids == [1, 2, 3]
    batch = parse_request("completions", b'{"prompt": ["a", "b"]}')
    assert batch.index_text == "a\nb"
    extra = parse_request("completions", b'{"prompt": "x", "temperature": 0.5, "ignore_eos": true}')
    assert extra.prompt_text == "x"  # unknown fields pass through to the worker untouched


def test_chat_is_flattened_so_a_conversation_prefix_stays_a_prefix() -> None:
    turn1 = parse_request(
        "chat", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}'
    )
    turn2 = parse_request(
        "chat",
        b'{"messages": [{"role": "user", "content": "hi"}, '
        b'{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]}',
    )
    assert turn1.max_tokens == 3 and turn2.max_tokens == 128
    common = turn1.index_text.removesuffix("\nassistant:")
    assert turn2.index_text.startswith(common)
    parts = parse_request(
        "chat",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
        b'{"type": "image_url"}]}]}',
    )
    assert parts.index_text == "user: a\nassistant:"
    assert flatten_chat([]) == "\nassistant:"


def test_generate_text_or_ids() -> None:
    g = parse_request("generate", b'{"text": "t u", "sampling_params": {"max_new_tokens": 4}}')
    assert (g.index_text, g.max_tokens, g.stream) == ("t u", 4, False)
    ids = parse_request("generate", b'{"input_ids": [9, 8], "stream": true}')
    assert ids.prompt_ids == [9, 8] and ids.max_tokens == 128 and ids.stream


@pytest.mark.parametrize(
    ("endpoint", "raw", "status", "needle"),
    [
        ("completions", b"{oops", 400, "not valid JSON"),
        ("completions", b"", 400, "empty"),
        ("completions", b"[]", 400, "JSON object"),
        ("completions", b'"prompt"', 400, "JSON object"),
        ("completions", b"{}", 400, "prompt"),
        ("completions", b'{"prompt": null}', 400, "prompt"),
        ("completions", b'{"prompt": []}', 400, "prompt"),
        ("completions", b'{"prompt": [true]}', 400, "prompt"),
        ("completions", b'{"prompt": [1, -1]}', 400, "non-negative"),
        ("completions", b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        ("completions", b'{"prompt": "x", "max_tokens": 1.5}', 400, "max_tokens"),
        ("completions", b'{"prompt": "x", "max_tokens": "2"}', 400, "max_tokens"),
        ("completions", b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
        ("completions", b'{"prompt": "x", "stream": 1}', 400, "stream"),
        ("completions", b'{"prompt": "x", "model": 3}', 400, "model"),
        ("chat", b'{"messages": []}', 400, "messages"),
        ("chat", b'{"messages": "hi"}', 400, "messages"),
        ("chat", b'{"messages": [{"content": "x"}]}', 400, "role"),
        ("chat", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -2}', 400, "max_tokens"),
        ("generate", b"{}", 400, "text"),
        ("generate", b'{"input_ids": []}', 400, "input_ids"),
        ("generate", b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
        ("generate", b'{"text": "x", "sampling_params": 5}', 400, "sampling_params"),
    ],
)
def test_bad_bodies_raise_request_error_in_openai_shape(
    endpoint: str, raw: bytes, status: int, needle: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(endpoint, raw)  # type: ignore[arg-type]
    err = info.value
    assert err.status == status
    assert needle in err.message
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_worker_urls_are_normalized_or_refused() -> None:
    assert normalize_worker_url("http://h:1/") == "http://h:1"
    assert normalize_worker_url(" https://h/v ") == "https://h/v"
    for bad in ("", "h:1", "ftp://h", "http://", "http://h:1?x=1", "http://h:notaport"):
        with pytest.raises(ValueError):
            normalize_worker_url(bad)
