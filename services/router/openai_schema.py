"""The seam between the router's OpenAI HTTP layer and the backend that talks to the mesh.

The HTTP layer turns JSON into a `CompletionRequest`, hands it to a `CompletionBackend` and
turns the events it yields back into OpenAI's wire format. Nothing here knows about gRPC or
HTTP, so both sides can be tested alone. The parsers are strict about types (a client bug
should be a 400 naming the field, not a 500 deep in the mesh) and lenient about unknown
fields (clients send many we don't use).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class RequestLimits:
    """Bounds the operator sets on what one request may ask (`pdmesh router` flags)."""

    max_n: int = 8  # choices per request (--max-n)
    max_top_logprobs: int = 20  # alternatives per token (--max-top-logprobs)


DEFAULT_LIMITS = RequestLimits()


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class CompletionRequest:
    kind: Literal["chat", "completion"]
    model: str
    messages: list[ChatMessage] | None  # chat
    prompt: str | None  # completion
    max_tokens: int  # DEFAULT_MAX_TOKENS when absent; capping to the context is the backend's job
    temperature: float  # 1.0 when absent, as in OpenAI; 0 means greedy
    top_p: float  # 1.0 when absent
    seed: int | None
    stop: list[str]  # a str or a list of str in JSON; applying them is the backend's job
    stream: bool
    include_usage: bool  # stream_options.include_usage
    n: int = 1  # independent choices, each its own mesh request (choice i's seed derived)
    logprobs: bool = False  # each generated token's logprob (chat: logprobs; completions:
    top_logprobs: int = 0  # logprobs=k sets both) and this many alternatives
    echo: bool = False  # completions: the prompt leads the text (and its logprobs)
    user: str | None = None  # the client's end user, put on the trace
    request_id: str | None = None  # the id the client sees (chatcmpl-..., cmpl-...), for tracing
    ignore_eos: bool = False  # not OpenAI's: set by the gRPC API for benchmarks
    top_k: int = 0  # not OpenAI's (vLLM and others accept it); 0 means no top-k


class RequestError(Exception):
    """A failure the client should see as an OpenAI error object with an HTTP status.

    Raised by the parsers and by the backend (before its first event: unknown model, prompt
    longer than the context, mesh unavailable...). Mid-stream it becomes an SSE error event.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds: sent as the Retry-After header

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"retry-after": str(self.retry_after)}

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class TokenLogprob:
    """One token's logprob as OpenAI reports it; ``logprob`` is None for a prompt's first
    token (nothing precedes it), ``top`` its most likely alternatives."""

    token: str
    bytes: list[int]
    logprob: float | None
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class TokenEvent:
    text: str
    token_id: int
    logprobs: list[TokenLogprob] | None = None  # one per token of `text`, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event, for echo


@dataclass
class FinishEvent:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


class CompletionBackend(Protocol):
    def model_ids(self) -> list[str]: ...

    def is_healthy(self) -> tuple[bool, str]:
        """False, with the reason, while the mesh cannot serve."""
        ...

    def metrics_text(self) -> str:
        """Prometheus exposition text."""
        ...

    def stream(self, req: CompletionRequest) -> AsyncIterator[TokenEvent | FinishEvent]:
        """An async generator of tokens ending with one FinishEvent.

        It may raise RequestError before its first event, or any exception later (mesh
        failure mid-stream). Closing it early is how a client disconnect aborts the request:
        the HTTP layer always closes it, either by cancelling the task awaiting it
        (CancelledError at an await) or by `aclose()` (GeneratorExit at a yield). Awaits in
        its cleanup run inside a cancelled scope and need a bounded shield.
        """
        ...


# --- parsing -----------------------------------------------------------------------------


def parse_chat_request(body: object, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    """Validate a /v1/chat/completions JSON body (already decoded)."""
    fields = _require_object(body)
    return CompletionRequest(
        kind="chat",
        model=_model(fields),
        messages=_messages(fields),
        prompt=None,
        # max_completion_tokens is the newer name; it wins when both are sent.
        **_sampling(fields, ("max_completion_tokens", "max_tokens"), limits),
        **_chat_logprobs(fields, limits),
    )


def parse_completion_request(
    body: object, limits: RequestLimits = DEFAULT_LIMITS
) -> CompletionRequest:
    """Validate a /v1/completions JSON body (already decoded)."""
    fields = _require_object(body)
    return CompletionRequest(
        kind="completion",
        model=_model(fields),
        messages=None,
        prompt=_prompt(fields),
        **_sampling(fields, ("max_tokens",), limits),
        **_completion_logprobs(fields, limits),
        echo=_optional_bool(fields, "echo"),
    )


def _invalid(param: str | None, message: str) -> RequestError:
    return RequestError(400, message, param=param)


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _invalid(None, "The request body must be a JSON object.")
    return body


def _model(fields: dict[str, Any]) -> str:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "'model' is required and must be a non-empty string.")
    return model


def _messages(fields: dict[str, Any]) -> list[ChatMessage]:
    raw = fields.get("messages")
    if not isinstance(raw, list):
        raise _invalid("messages", "'messages' is required and must be a list.")
    if not raw:
        raise _invalid("messages", "'messages' must contain at least one message.")
    return [_message(item, f"messages[{i}]") for i, item in enumerate(raw)]


def _message(item: object, where: str) -> ChatMessage:
    if not isinstance(item, dict):
        raise _invalid(where, f"'{where}' must be an object with 'role' and 'content'.")
    role = item.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        allowed = ", ".join(sorted(CHAT_ROLES))
        raise _invalid(f"{where}.role", f"'{where}.role' must be one of: {allowed}.")
    return ChatMessage(role=role, content=_content(item.get("content"), f"{where}.content"))


def _content(raw: object, where: str) -> str:
    """A string, or a list of text parts (`{"type": "text", "text": ...}`) joined together."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for i, part in enumerate(raw):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise _invalid(
                    f"{where}[{i}]", f"'{where}[{i}]' must be a text part; only text is supported."
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(where, f"'{where}' must be a string or a list of text parts.")


def _prompt(fields: dict[str, Any]) -> str:
    raw = fields.get("prompt")
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise _invalid(
            "prompt", "'prompt' is required and must be a string (or a list of one string)."
        )
    return raw


def _sampling(
    fields: dict[str, Any], max_tokens_names: tuple[str, ...], limits: RequestLimits
) -> dict[str, Any]:
    """Fields common to both endpoints, as CompletionRequest keyword arguments."""
    max_tokens = _max_tokens(fields, max_tokens_names)
    temperature = _optional_number(fields, "temperature", default=1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _invalid("temperature", "'temperature' must be between 0 and 2.")
    top_p = _optional_number(fields, "top_p", default=1.0)
    if not 0.0 < top_p <= 1.0:
        raise _invalid("top_p", "'top_p' must be greater than 0 and at most 1.")
    top_k = _optional_int(fields, "top_k") or 0
    if top_k < 0:
        raise _invalid("top_k", "'top_k' must be at least 0 (0 means no top-k).")
    n = _optional_int(fields, "n")
    if n is not None and not 1 <= n <= limits.max_n:
        raise _invalid("n", f"'n' must be between 1 and {limits.max_n}.")
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid("user", "'user' must be a string.")
    return {
        "n": n or 1,
        "user": user,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": _optional_int(fields, "seed"),
        "stop": _stop(fields),
        "stream": _optional_bool(fields, "stream"),
        "include_usage": _include_usage(fields),
    }


def _chat_logprobs(fields: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (alternatives, needs logprobs)."""
    logprobs = _optional_bool(fields, "logprobs")
    top = _top_logprobs(fields, "top_logprobs", limits)
    if top and not logprobs:
        raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs' set to true.")
    return {"logprobs": logprobs, "top_logprobs": top}


def _completion_logprobs(fields: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    """Completions' `logprobs`: an integer, the alternatives per token (0: the chosen
    token's logprob alone); absent or null, no logprobs."""
    if fields.get("logprobs") is None:
        return {"logprobs": False, "top_logprobs": 0}
    return {"logprobs": True, "top_logprobs": _top_logprobs(fields, "logprobs", limits)}


def _top_logprobs(fields: dict[str, Any], name: str, limits: RequestLimits) -> int:
    top = _optional_int(fields, name) or 0
    if not 0 <= top <= limits.max_top_logprobs:
        raise _invalid(name, f"'{name}' must be between 0 and {limits.max_top_logprobs}.")
    return top


def _max_tokens(fields: dict[str, Any], names: tuple[str, ...]) -> int:
    """The first of `names` present; DEFAULT_MAX_TOKENS when none is."""
    for name in names:
        value = _optional_int(fields, name)
        if value is not None:
            if value <= 0:
                raise _invalid(name, f"'{name}' must be at least 1.")
            return value
    return DEFAULT_MAX_TOKENS


def _optional_int(fields: dict[str, Any], name: str) -> int | None:
    raw = fields.get(name)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _invalid(name, f"'{name}' must be an integer.")
    return raw


def _optional_number(fields: dict[str, Any], name: str, default: float) -> float:
    raw = fields.get(name)
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise _invalid(name, f"'{name}' must be a number.")
    return float(raw)


def _optional_bool(fields: dict[str, Any], name: str, param: str | None = None) -> bool:
    raw = fields.get(name)
    if raw is None:
        return False
    if not isinstance(raw, bool):
        param = param or name
        raise _invalid(param, f"'{param}' must be a boolean.")
    return raw


def _stop(fields: dict[str, Any]) -> list[str]:
    raw = fields.get("stop")
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise _invalid("stop", "'stop' must be a string or a list of strings.")
    return [s for s in raw if s]  # an empty stop string would match everywhere


def _include_usage(fields: dict[str, Any]) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object.")
    return _optional_bool(options, "include_usage", param="stream_options.include_usage")
