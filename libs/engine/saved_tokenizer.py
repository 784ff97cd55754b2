"""A saved tokenizer directory read with the `tokenizers` library and jinja2 alone.

`Tokenizer.load` of a GGUF converts the GGUF's tokenizer once with transformers and saves
it under the cache dir: `tokenizer.json` (the BPE model, its pre-tokenizer, decoder and
added tokens), `tokenizer_config.json` (which added tokens are bos, eos, pad, unk) and
`chat_template.jinja`. Reading that save back through transformers costs every process
about 1.5 s of imports, and the router, each prefill and each decode pays it at every
start. This reads the same files directly:

- text is encoded by the same `tokenizers` object transformers would wrap, with no special
  tokens added (the engine's prompts carry their own);
- ids are decoded by it too, with no clean-up of spaces (transformers' default);
- the chat template is rendered the way transformers renders it: a sandboxed jinja2
  environment with `trim_blocks` and `lstrip_blocks`, the loop controls extension, and
  its `raise_exception`, `tojson` and `strftime_now`; the rendered text is then encoded.

`tests/engine/test_saved_tokenizer.py` holds it to transformers on the same directory.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json")


def is_saved(directory: Path) -> bool:
    """Whether ``directory`` holds a save this module can read."""
    return all((directory / name).is_file() for name in FILES)


class SavedTokenizer:
    """The calls the engine makes of a transformers tokenizer, on a saved directory."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self.special_tokens = {name: _content(config.get(name))
                               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        self.pad_token_id = self._id_of(self.special_tokens["pad_token"])
        template_file = directory / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else \
            config.get("chat_template")
        self._template = _compile(source) if source else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special_tokens.items()
                                        if v is not None})
        return self.encode(text) if tokenize else text


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an added token's
    fields with its text under "content"."""
    return token.get("content") if isinstance(token, dict) else token


def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja's own tojson escapes HTML characters, which a prompt must keep as they are
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
