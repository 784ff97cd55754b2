"""Tokenizer from GGUF metadata and streaming detokenization."""

from __future__ import annotations

import pytest

from libs.engine.tokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "Hello, world! Plain ASCII.",
    "Café crème brûlée, naïve façade — Ελληνικά, русский, 日本語のテキスト",
    "Emoji: 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and ❤️ done",
    "mixed\n\ttabs  and   spaces 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
]


def test_encode_decode_roundtrip(tokenizer):
    for t in TEXTS:
        assert tokenizer.decode(tokenizer.encode(t)) == t


def test_chat_template(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system")
    assert text.endswith("<|im_start|>assistant\n")
    assert 2 in tokenizer.eos_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer)
    deltas = [det.push(i) for i in ids]
    deltas.append(det.finish())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [2, 3, 7])
def test_tokens_pushed_in_groups_give_the_same_text(tokenizer, text, size):
    """push_many (a stream's chunk of tokens at once) yields the one-by-one text, with
    groups that end inside a multi-byte character held back until it completes."""
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer)
    deltas = [det.push_many(ids[i : i + size]) for i in range(0, len(ids), size)]
    deltas.append(det.finish())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_pieces_are_held_back(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # split over byte tokens
    det = IncrementalDetokenizer(tokenizer)
    assert [det.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.push(ids[-1]) == "🎉"


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Done.") + [2]
    det = IncrementalDetokenizer(tokenizer)
    assert "".join(det.push(i) for i in ids) + det.finish() == "Done."


def test_stop_string_trims_and_holds_back(tokenizer):
    text = "The answer is 42. STOP here and more text"
    det = IncrementalDetokenizer(tokenizer, stop=["STOP", "never"])
    out = []
    for i in tokenizer.encode(text):
        out.append(det.push(i))
        if det.stopped:
            break
    assert det.stopped and det.stop_reason == "STOP"
    assert "".join(out) == "The answer is 42. "
    assert det.text == "The answer is 42. "
    assert det.finish() == ""


def test_stop_prefix_released_when_no_match(tokenizer):
    text = "a STO then nothing"
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    out = "".join(det.push(i) for i in tokenizer.encode(text)) + det.finish()
    assert out == text and not det.stopped


def test_check_stop(tokenizer):
    det = IncrementalDetokenizer(tokenizer)
    for i in tokenizer.encode("Hello world. User: next"):
        det.push(i)
    assert det.check_stop(["User:"]) == "Hello world. "
    assert det.check_stop(["nope"]) is None
    assert find_stop("abcabc", ["c", "b"]) == (1, "b")
