"""OpenAI response objects for chat and text completions, streaming and not.

Pure functions of what the backend produced: no I/O, so the exact wire format can be read
(and tested) in one place. One `CompletionWire` per request fixes the `id` and `created`
that every chunk of a stream must share.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.router.openai_schema import CompletionRequest, FinishEvent, TokenLogprob


def new_completion_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return prefix + uuid.uuid4().hex


def usage_object(finishes: list[FinishEvent]) -> dict[str, int]:
    """One prompt, however many choices: their completion tokens add up (as OpenAI's)."""
    prompt = finishes[0].prompt_tokens if finishes else 0
    completion = sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass
class ChoiceOutput:
    """Everything one choice produced, for a non-streaming response."""

    text: str
    finish: FinishEvent
    logprobs: list[TokenLogprob] | None  # None when the request asked for none


def _alternative(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's `logprobs` object: one content entry per token, with its alternatives."""
    if entries is None:
        return None
    content = [{**_alternative(e), "top_logprobs": [_alternative(t) for t in e.top]}
               for e in entries]
    return {"content": content, "refusal": None}


def text_logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Completions' `logprobs` object: parallel lists, the alternatives as {token: logprob}
    (None for an echoed prompt's first token), and each token's offset in the choice's
    text, counting from `offset`."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


@dataclass
class CompletionWire(ABC):
    """Builds every object of one response; `for_request` picks chat or text completion.

    Choices are numbered by `index` (n > 1): a stream interleaves their chunks."""

    chunk_object: ClassVar[str]

    model: str
    include_usage: bool
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @staticmethod
    def for_request(req: CompletionRequest) -> CompletionWire:
        wire_class = ChatWire if req.kind == "chat" else TextWire
        return wire_class(
            model=req.model,
            include_usage=req.include_usage,
            id=req.request_id or new_completion_id(req.kind),
        )

    def opening_chunks(self, n: int = 1) -> list[dict[str, Any]]:
        """Chunks sent before the first token."""
        return []

    @abstractmethod
    def token_chunk(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]: ...

    @abstractmethod
    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]: ...

    def usage_chunk(self, finishes: list[FinishEvent]) -> dict[str, Any]:
        """The extra chunk of stream_options.include_usage, right before [DONE]."""
        return {**self._envelope(self.chunk_object), "choices": [],
                "usage": usage_object(finishes)}

    @abstractmethod
    def full_response(self, choices: list[ChoiceOutput]) -> dict[str, Any]: ...

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return chunk


class ChatWire(CompletionWire):
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def opening_chunks(self, n: int = 1) -> list[dict[str, Any]]:
        return [self._delta(i, {"role": "assistant", "content": ""}, None) for i in range(n)]

    def token_chunk(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        return self._delta(index, {"content": text}, None, chat_logprobs(logprobs))

    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._delta(index, {}, finish_reason)

    def full_response(self, choices: list[ChoiceOutput]) -> dict[str, Any]:
        return {
            **self._envelope("chat.completion"),
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs),
                    "finish_reason": c.finish.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage_object([c.finish for c in choices]),
        }

    def _delta(
        self, index: int, delta: dict[str, Any], finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self._chunk(
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        )


@dataclass
class TextWire(CompletionWire):
    chunk_object: ClassVar[str] = "text_completion"
    # each choice's text streamed so far, in characters: where its next token's text_offset
    # counts from
    streamed: dict[int, int] = field(default_factory=dict)

    def token_chunk(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        offset = self.streamed.get(index, 0)
        self.streamed[index] = offset + len(text)
        return self._chunk(self._choice(index, text, None, text_logprobs(logprobs, offset)))

    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk(self._choice(index, "", finish_reason))

    def full_response(self, choices: list[ChoiceOutput]) -> dict[str, Any]:
        return {
            **self._envelope("text_completion"),
            "choices": [
                self._choice(i, c.text, c.finish.finish_reason, text_logprobs(c.logprobs))
                for i, c in enumerate(choices)
            ],
            "usage": usage_object([c.finish for c in choices]),
        }

    @staticmethod
    def _choice(
        index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs,
                "finish_reason": finish_reason}
