"""Tokenizer, chat template and incremental detokenization.

The tokenizer.json and chat template are the ones transformers writes or reads for
the model, run with the `tokenizers` library and a sandboxed Jinja environment set
up as transformers sets it up, so a raw prompt is split exactly as transformers
splits it (for SmolLM2: no BOS is added) without importing transformers at start.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RawTokenizer

from appliance.model.errors import ModelLoadError

# End-of-turn markers of common chat templates; one that the template uses stops generation.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text to token ids and back, plus the model's chat template."""

    def __init__(
        self,
        raw: RawTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        extra_eos_ids: tuple[int, ...] = (),
    ) -> None:
        self._raw = raw
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
        self.stop_token_ids = self._find_stop_ids(extra_eos_ids)

    @classmethod
    def load(cls, folder: Path, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and any chat_template.jinja from a folder."""
        try:
            raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
            config_path = folder / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise ModelLoadError(folder, f"cannot load its tokenizer ({exc})") from None
        specials = {k: _token_text(config[k]) for k in _SPECIAL_KEYS if config.get(k)}
        return cls(raw, specials, _read_template(folder, config), extra_eos_ids)

    def _find_stop_ids(self, extra: tuple[int, ...]) -> frozenset[int]:
        ids = set(extra)
        names = [self.special_tokens.get("eos_token")]
        names += [t for t in _END_OF_TURN_TOKENS if t in (self.chat_template or "")]
        ids.update(i for n in names if n and (i := self._raw.token_to_id(n)) is not None)
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        """A raw prompt, with whatever special tokens the model's tokenizer adds."""
        return self._raw.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """Messages rendered by the model's template, ready for the assistant's turn."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt instead")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, **self.special_tokens
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template already holds any BOS; adding special tokens again would double it.
        return self._raw.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._raw.decode(ids, skip_special_tokens=True)


def _token_text(value: str | dict) -> str:
    return value["content"] if isinstance(value, dict) else value


def _read_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _compile_template(source: str) -> Any:
    """The Jinja environment transformers renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # a few tokens of context so merges decode right
        self._read_offset = 0  # ids before this are already emitted as text

    def add(self, token_id: int) -> str:
        """Append a token; return the new text that is now complete (may be empty)."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence (or nothing visible) so far
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """The text still held back at the end of generation (even if not valid UTF-8)."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]
