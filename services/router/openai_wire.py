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

from services.router.openai_schema import CompletionRequest, FinishEvent


def new_completion_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return prefix + uuid.uuid4().hex


def usage_object(finish: FinishEvent) -> dict[str, int]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


@dataclass
class CompletionWire(ABC):
    """Builds every object of one response; `for_request` picks chat or text completion."""

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

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token."""
        return []

    @abstractmethod
    def token_chunk(self, text: str) -> dict[str, Any]: ...

    @abstractmethod
    def finish_chunk(self, finish_reason: str) -> dict[str, Any]: ...

    def usage_chunk(self, finish: FinishEvent) -> dict[str, Any]:
        """The extra chunk of stream_options.include_usage, right before [DONE]."""
        return {**self._envelope(self.chunk_object), "choices": [], "usage": usage_object(finish)}

    @abstractmethod
    def full_response(self, text: str, finish: FinishEvent) -> dict[str, Any]: ...

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return chunk


class ChatWire(CompletionWire):
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def token_chunk(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._delta({}, finish_reason)

    def full_response(self, text: str, finish: FinishEvent) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish.finish_reason,
        }
        return {
            **self._envelope("chat.completion"),
            "choices": [choice],
            "usage": usage_object(finish),
        }

    def _delta(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        )


class TextWire(CompletionWire):
    chunk_object: ClassVar[str] = "text_completion"

    def token_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(self._choice(text, None))

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._choice("", finish_reason))

    def full_response(self, text: str, finish: FinishEvent) -> dict[str, Any]:
        return {
            **self._envelope("text_completion"),
            "choices": [self._choice(text, finish.finish_reason)],
            "usage": usage_object(finish),
        }

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
