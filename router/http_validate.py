"""Parse and validate the bodies of the OpenAI and SGLang generation endpoints.

The router forwards the client's raw bytes unchanged; it only needs a few fields to route (the text the
prefix index sees, the prompt length, max tokens, stream, model). The simulated worker uses the same
parser, so both sides accept and reject exactly the same inputs.

Validation is strict (no "16" -> 16 coercion, like the OpenAI API): a wrong type is the client's error,
reported as HTTP 400 with the OpenAI error body, never a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Endpoint = Literal["completions", "chat", "generate"]

# Defaults when the client gives no limit: the OpenAI API's 16 for completions; SGLang's 128 for /generate;
# for chat the engines default to "until the context is full", which a simulator cannot mirror, so 128.
DEFAULT_MAX_TOKENS: dict[str, int] = {"completions": 16, "chat": 128, "generate": 128}


class RequestError(Exception):
    """A client error: carries the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _CompletionBody(_Strict):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class _ChatMessage(_Strict):
    role: str
    content: str | list[_ContentPart] | None = None


class _ChatBody(_Strict):
    model: str | None = None
    messages: list[_ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False


class _SamplingParams(_Strict):
    max_new_tokens: int | None = Field(default=None, ge=0)


class _GenerateBody(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: _SamplingParams | None = None
    stream: bool = False
    model: str | None = None


_BODY_MODELS: dict[str, type[_Strict]] = {
    "completions": _CompletionBody,
    "chat": _ChatBody,
    "generate": _GenerateBody,
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What routing (and the simulated engine) needs from a generation request.

    Invariant: exactly one of ``prompt_text`` / ``prompt_ids`` is the prompt as the engine sees it;
    ``index_text`` is always set (ids are rendered as decimal words so prefixes stay prefixes).
    """

    endpoint: Endpoint
    index_text: str
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    stream: bool
    model: str | None


def flatten_chat(messages: list[_ChatMessage]) -> str:
    """Messages -> one prompt string, in order, so a conversation's prefix stays a prefix of its next turn."""
    parts: list[str] = []
    for m in messages:
        if isinstance(m.content, list):
            content = " ".join(p.text for p in m.content if p.text)
        else:
            content = m.content or ""
        parts.append(f"{m.role}: {content}")
    return "\n".join(parts) + "\nassistant:"


def _ids_text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _is_union_tag(part: object) -> bool:
    """pydantic puts the tried union member into error locations ('str', 'list[int]', '_ContentPart')."""
    return isinstance(part, str) and (
        part in ("str", "int", "bool", "none") or "[" in part or part.startswith("_")
    )


def _describe(exc: ValidationError) -> RequestError:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return RequestError(
            400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}".strip()
        )
    if err["type"] == "model_type" and not err["loc"]:
        return RequestError(400, "request body must be a JSON object")
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    param = str(err["loc"][0]) if err["loc"] else None
    return RequestError(400, f"invalid field '{loc}': {err['msg']}", param=param)


def _check_ids(ids: list[int], name: str) -> None:
    if any(i < 0 for i in ids):
        raise RequestError(400, f"invalid field '{name}': token ids must be non-negative", param=name)


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    """Parse one request body; raises RequestError (4xx) on any client mistake."""
    model_cls = _BODY_MODELS[endpoint]
    if not raw:
        raise RequestError(400, "request body is empty; expected a JSON object")
    try:
        body = model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise _describe(exc) from None
    default = DEFAULT_MAX_TOKENS[endpoint]
    if isinstance(body, _CompletionBody):
        prompt = body.prompt
        ids: list[int] | None = None
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
        elif not prompt:
            raise RequestError(400, "invalid field 'prompt': must not be empty", param="prompt")
        elif isinstance(prompt[0], str):
            text = "\n".join(prompt)  # a batch is routed as one unit (one worker serves it)
        elif isinstance(prompt[0], int):
            ids = list(prompt)  # type: ignore[arg-type]
        else:
            ids = [i for sub in prompt for i in sub]  # type: ignore[union-attr]
        if ids is not None:
            _check_ids(ids, "prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else default
        return ParsedRequest(
            "completions",
            text if text is not None else _ids_text(ids or []),
            text,
            ids,
            max_tokens,
            body.stream,
            body.model,
        )
    if isinstance(body, _ChatBody):
        text = flatten_chat(body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return ParsedRequest(
            "chat", text, text, None, limit if limit is not None else default, body.stream, body.model
        )
    assert isinstance(body, _GenerateBody)
    if body.text is None and body.input_ids is None:
        raise RequestError(400, "missing field: /generate needs 'text' or 'input_ids'", param="text")
    sp = body.sampling_params
    max_tokens = sp.max_new_tokens if sp is not None and sp.max_new_tokens is not None else default
    if body.text is not None:
        text = body.text if isinstance(body.text, str) else "\n".join(body.text)
        return ParsedRequest("generate", text, text, None, max_tokens, body.stream, body.model)
    raw_ids = body.input_ids or []
    ids = [i for sub in raw_ids for i in sub] if raw_ids and isinstance(raw_ids[0], list) else list(raw_ids)  # type: ignore[misc]
    if not ids:
        raise RequestError(400, "invalid field 'input_ids': must not be empty", param="input_ids")
    _check_ids(ids, "input_ids")
    return ParsedRequest("generate", _ids_text(ids), None, ids, max_tokens, body.stream, body.model)
