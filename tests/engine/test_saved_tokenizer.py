"""SavedTokenizer (libs/engine/saved_tokenizer.py) reads the cache's save of SmolLM2's GGUF
tokenizer without transformers; here transformers reads the same directory and every call
the engine makes must answer alike."""

from __future__ import annotations

import random

import pytest

from libs.engine import tokenizer as tokenizer_module
from libs.engine.saved_tokenizer import SavedTokenizer, is_saved
from libs.engine.specs import smollm2_gguf_path

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "numbers 1234567890 3.14159 -42 1e10",
    "unicode: café naïve Ωμέγα привет 你好世界 こんにちは 🙂🚀👍🏽",
    "code: def f(x):\n    return {'a': [x, x**2]}  # comment",
    "control tokens in text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "",
    " ",
    "a" * 300,
    "Mixed CASE and_snake_case and camelCase and URLs https://example.com/a?b=c&d=e",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Good morning"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about <|im_end|> tokens 🙂"}],
]


@pytest.fixture(scope="module")
def both():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer_module.Tokenizer.load(path)  # makes the cache entry if this machine has none
    directory = tokenizer_module.cache_dir() / tokenizer_module._gguf_key(path)
    assert is_saved(directory)
    return SavedTokenizer(directory), AutoTokenizer.from_pretrained(str(directory),
                                                                     local_files_only=True)


def test_encode_matches_transformers(both):
    saved, hf = both
    for text in TEXTS:
        assert saved.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_decode_matches_transformers_with_and_without_special_tokens(both):
    saved, hf = both
    rng = random.Random(0)
    sequences = [saved.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))]
                  for _ in range(200)]
    sequences += [[1, 2, 0, *saved.encode("mid"), 2]]  # special ids around text
    for ids in sequences:
        for skip in (True, False):
            assert saved.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_vocabulary_pieces_and_special_ids_match_transformers(both):
    saved, hf = both
    assert len(saved) == len(hf)
    assert saved.eos_token_id == hf.eos_token_id and saved.pad_token_id == hf.pad_token_id
    assert [saved.convert_ids_to_tokens(i) for i in range(len(hf))] == \
        hf.convert_ids_to_tokens(list(range(len(hf))))


def test_chat_template_matches_transformers(both):
    saved, hf = both
    for chat in CHATS:
        for generation_prompt in (True, False):
            expected = hf.apply_chat_template(chat, add_generation_prompt=generation_prompt,
                                              tokenize=True)
            if hasattr(expected, "keys"):
                expected = expected["input_ids"]
            assert saved.apply_chat_template(chat, add_generation_prompt=generation_prompt) \
                == list(expected), chat
            assert saved.apply_chat_template(chat, tokenize=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_the_engines_tokenizer_reads_the_save_without_transformers(both):
    """A process that finds the save (the fixture made sure of it) never imports
    transformers: the point of the module."""
    import subprocess
    import sys

    code = ("import sys; from libs.engine.tokenizer import Tokenizer; "
            "from libs.engine.specs import smollm2_gguf_path; "
            "t = Tokenizer.load(smollm2_gguf_path()); "
            "assert t.encode('hi there') and t.apply_chat_template("
            "[{'role': 'user', 'content': 'hi'}]); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
