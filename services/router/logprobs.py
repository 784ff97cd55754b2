"""The mesh's token logprobs (ids and numbers) as OpenAI reports them: with each token's
text and bytes.

A byte-level BPE token can be part of a UTF-8 character, so its text alone can be a
replacement character; its bytes (OpenAI's `bytes`) are exact, and a client joins them
to rebuild the text.
"""

from __future__ import annotations

import functools

from libs.engine.tokenizer import Tokenizer
from pdmesh.v1 import common_pb2 as cpb
from services.router.openai_schema import TokenLogprob


class LogprobText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._piece = functools.lru_cache(maxsize=65536)(self._token_piece)

    def described(self, logprob: cpb.TokenLogprob) -> TokenLogprob:
        """A token's logprob with its text, and its alternatives'."""
        top = [self.entry(token, value)
               for token, value in zip(logprob.top_ids, logprob.top_logprobs, strict=True)]
        return self.entry(logprob.token_id, logprob.logprob, top)

    def entry(self, token_id: int, logprob: float | None,
              top: list[TokenLogprob] | None = None) -> TokenLogprob:
        text, raw = self._piece(token_id)
        return TokenLogprob(token=text, bytes=list(raw), logprob=logprob, top=top or [])

    def _token_piece(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw
