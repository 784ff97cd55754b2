"""Tokenizer built offline from a GGUF's metadata, plus streaming detokenization.

Building a fast tokenizer from GGUF metadata takes seconds (it re-derives the BPE model), so the
result is saved once as a regular tokenizer directory under the cache dir and reloaded from there
without transformers (libs/engine/saved_tokenizer.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from libs.engine import saved_tokenizer

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("PDMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdmesh"
    )
    return Path(root) / "tokenizers"


def _gguf_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:24]


def _load_hf_tokenizer(source: str):
    # AutoTokenizer is imported only where used: naming it imports torch (through
    # transformers' config modules), which the router otherwise never loads
    path = Path(source)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cached = cache_dir() / _gguf_key(path)
    if saved_tokenizer.is_saved(cached):
        try:
            # our own save of a GGUF's tokenizer, read without importing transformers
            return saved_tokenizer.SavedTokenizer(cached)
        except Exception:  # a stale or partial cache entry: rebuild it below
            logger.warning("tokenizer cache %s unreadable, rebuilding", cached)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    try:  # write to a temp dir then rename, so concurrent loaders never see half a cache
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(cached)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache tokenizer: %s", e)
    # the first load serves from the save too, so every process tokenizes alike
    return saved_tokenizer.SavedTokenizer(cached) if saved_tokenizer.is_saved(cached) else tok


class Tokenizer:
    """Thin wrapper over a tokenizer (transformers', or a SavedTokenizer of a GGUF's) with
    the calls the engine needs."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

    @classmethod
    def load(cls, source: str | os.PathLike, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """From a .gguf file or a tokenizer directory; cached per source in-process."""
        return cls(_cached_hf(str(source)), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may be part of a UTF-8
        character, which its decoded text cannot show): what OpenAI's logprobs report."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


@functools.lru_cache(maxsize=8)
def _cached_hf(source: str):
    t0 = time.perf_counter()
    tok = _load_hf_tokenizer(source)
    logger.info("tokenizer from %s loaded in %.2fs", source, time.perf_counter() - t0)
    return tok


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest (index, stop string) occurring in text[start:], or None."""
    best: tuple[int, str] | None = None
    for s in stop_strings:
        if not s:
            continue
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never split a UTF-8 character.

    Keeps a short window of tokens (prefix..read) and decodes it twice: text that ends in the
    replacement char is an incomplete byte sequence and is held back until later tokens finish
    it. With ``stop`` strings, text that could still become a stop string is held back too, and
    on a match ``stopped`` is set and the delta ends right before the stop string.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = 0  # tokens up to here are decoded into self._decoded
        self._decoded = ""  # all complete text so far
        self._emitted = 0  # chars of _decoded handed out
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """Text handed out so far."""
        return self._decoded[: self._emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is safe to emit (may be "")."""
        return self.push_many((token_id,))

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add several tokens with two decodes in all, not two each; the text is the
        same as pushing them one by one, but a stop string is found only after the
        last of them (push one by one to learn which token completed it)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return ""  # incomplete UTF-8 sequence (or nothing visible yet)
        self._decoded += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if not self.stop:
            out = self._decoded[self._emitted :]
            self._emitted = len(self._decoded)
            return out
        longest = max(len(s) for s in self.stop)
        hit = find_stop(self._decoded, self.stop, max(0, self._emitted - longest + 1))
        if hit is not None:
            self.stopped, self.stop_reason = True, hit[1]
            self._decoded = self._decoded[: hit[0]]
            end = len(self._decoded)
        else:  # hold back a tail that is a prefix of some stop string
            end = len(self._decoded)
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self._decoded)), 0, -1):
                    if self._decoded.endswith(s[:k]):
                        end = min(end, len(self._decoded) - k)
                        break
        end = max(end, self._emitted)
        out = self._decoded[self._emitted : end]
        self._emitted = end
        return out

    def finish(self) -> str:
        """At end of stream: release held-back text (an unfinished character stays dropped)."""
        if self.stopped:
            return ""
        out = self._decoded[self._emitted :]
        self._emitted = len(self._decoded)
        return out

    def check_stop(self, stop_strings: Sequence[str]) -> str | None:
        """Full text trimmed before the first of ``stop_strings`` if one occurs, else None."""
        hit = find_stop(self._decoded, stop_strings)
        return None if hit is None else self._decoded[: hit[0]]
