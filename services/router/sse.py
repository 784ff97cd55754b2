"""Server-sent events framing for OpenAI streams: `data: <json>\\n\\n`, ended by `data: [DONE]`.

Kept apart from the OpenAI objects so the framing rules live in one place.
"""

from __future__ import annotations

import json
from typing import Any

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    """One event carrying `payload` as compact JSON (JSON never contains a raw newline)."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
