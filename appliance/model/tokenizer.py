"""Tokenizer, chat template and incremental detokenization.

The tokenizer.json and chat template are the ones transformers writes or reads for
the model, run with the `tokenizers` library and a sandboxed Jinja environment set
up as transformers sets it up, so a raw prompt is split exactly as transformers
splits it (for SmolLM2: no BOS is added) and a chat renders exactly as transformers'
`apply_chat_template` renders it, without importing transformers at start.
"""

from __future__ import annotations

import copy
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import llguidance
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RawTokenizer

from appliance.model.errors import ModelLoadError

# End-of-turn markers of common chat templates; one that the template uses stops generation.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
# Harmony's (gpt-oss): a reply ends with <|return|>, a tool call with <|call|> (the ids of
# the model's generation_config.json).
_HARMONY_END_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")
# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES);
# any other `*_token` entry of tokenizer_config.json is passed too (a model-specific token).
_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning comes under; transformers fills `reasoning_content` (and
# `thinking`) from whichever is set, as templates read those.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What render_chat itself passes the template: chat_template_kwargs may not replace them.
_RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


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
        self._takes_tools = _reads_variable(chat_template, "tools")
        self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
        self.stop_token_ids = self._find_stop_ids(extra_eos_ids)
        self._holding: dict[str, frozenset[int]] = {}  # ids_holding's, by text

    @classmethod
    def load(
        cls, folder: Path, extra_eos_ids: tuple[int, ...] = (), chat_template: str | None = None
    ) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and any chat_template.jinja from a
        folder; the eos_token_id of a generation_config.json there stops generation too.
        `chat_template` (the chat_template setting) replaces the model's own."""
        try:
            raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
            config = _read_json(folder / "tokenizer_config.json")
            if "added_tokens_decoder" not in config:  # transformers' legacy layout
                config.update(_read_json(folder / "special_tokens_map.json"))
            generation = _read_json(folder / "generation_config.json")
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise ModelLoadError(folder, f"cannot load its tokenizer ({exc})") from None
        eos_ids = extra_eos_ids + _token_ids(generation.get("eos_token_id"))
        try:
            template = chat_template or _read_template(folder, config)
            return cls(raw, _special_tokens(config), template, eos_ids)
        except ValueError as exc:  # a chat template that does not compile
            raise ModelLoadError(folder, str(exc)) from None

    def with_template(self, source: str) -> Tokenizer:
        """This tokenizer rendering chats with `source`, a Jinja chat template, instead of
        its own (a request's chat_template); ValueError where it does not compile."""
        other = copy.copy(self)
        other.chat_template = source
        other._template = _compile_template(source)
        other._takes_tools = _reads_variable(source, "tools")
        return other

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was built from, as text (for libraries that
        build their own view of the vocabulary, such as the grammar engine)."""
        return self._raw.to_str()

    def _find_stop_ids(self, extra: tuple[int, ...]) -> frozenset[int]:
        ids = set(extra)
        names = [self.special_tokens.get("eos_token")]
        template = self.chat_template or ""
        # In harmony (gpt-oss) <|end|> ends one message of a turn that goes on.
        ends = _HARMONY_END_TOKENS if "<|channel|>" in template else _END_OF_TURN_TOKENS
        names += [t for t in ends if t in template]
        ids.update(i for n in names if n and (i := self._raw.token_to_id(n)) is not None)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt, with whatever special tokens the model's tokenizer adds (a BOS),
        unless add_special_tokens is False."""
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Text as text: a special token's spelling in it ("<|im_start|>" in code being
        edited) is its characters, never the marker (llama.cpp's parse_special false)."""
        return self._literal.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _literal(self) -> RawTokenizer:
        # A copy: the switch is the tokenizer's own state, and others encode concurrently.
        literal = RawTokenizer.from_str(self._raw.to_str())
        literal.encode_special_tokens = True
        return literal

    def token_id(self, text: str) -> int | None:
        """The id of a token of the vocabulary (a special one: "<|fim_prefix|>"), or None."""
        return self._raw.token_to_id(text)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary as stored ("Ġhello" for " hello" in a
        byte-level BPE): transformers' convert_ids_to_tokens."""
        return [self._raw.id_to_token(i) or "" for i in ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> str:
        """Messages rendered by the model's template, ready for the assistant's turn: what
        transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=True,
        **template_kwargs) renders. `tools` are OpenAI's tool definitions ({"type":
        "function", "function": {...}}), as transformers hands them to the template;
        `template_kwargs` are extra template variables (e.g. enable_thinking).
        `continue_final` (transformers' continue_final_message): the last message, an
        assistant's, left open to be continued (a prefill), without a generation prompt."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt instead")
        if not messages:
            raise ValueError("there are no messages to render")
        extra = dict(template_kwargs or {})
        clash = template_kwargs_clash(extra)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        try:
            rendered = self._template.render(
                # transformers: the special tokens, then the caller's kwargs over them
                **{**self.special_tokens, **extra},
                messages=_template_messages(messages),
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt and not continue_final,
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return _left_open(rendered, messages[-1]) if continue_final else rendered

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders tool definitions (reads a `tools` variable);
        Phi-4-mini's reads them from the system message's own `tools` key instead."""
        return self._takes_tools

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> list[int]:
        # The template already holds any BOS; adding special tokens again would double it.
        text = self.render_chat(
            messages, tools, template_kwargs, add_generation_prompt, continue_final
        )
        return self._raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; `skip_special_tokens=False` keeps markers such as
        `<|python_tag|>` or `<|channel|>`, which the chat output parsers read."""
        return self._raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A character split over tokens (an emoji, most CJK)
        is split bytes, which no decoding of one token as text can show (it reads U+FFFD):
        logprobs' `bytes` and llama.cpp's pieces carry these, so a client joins them. A
        special token is its marker's text; an id outside the vocabulary, nothing."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._byte_table.decode_bytes([token_id])

    def ids_holding(self, texts: tuple[str, ...]) -> frozenset[int]:
        """The ids of the tokens whose bytes hold one of `texts` whole (DRY's sequence
        breakers: every token with a newline in it, say). Each text's set is found once."""
        found: set[int] = set()
        for text in texts:
            ids = self._holding.get(text)
            if ids is None:
                wanted = text.encode("utf-8", "surrogatepass")
                ids = frozenset(i for i, raw in enumerate(self._all_bytes) if wanted in raw)
                self._holding[text] = ids
            found |= ids
        return frozenset(found)

    @functools.cached_property
    def _all_bytes(self) -> list[bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    @functools.cached_property
    def _byte_table(self) -> llguidance.LLTokenizer:
        # llguidance reads every vocabulary's bytes (byte-level BPE's mapped characters,
        # SentencePiece's <0xNN> fallback): built at first use, ~0.4 s for 49k tokens.
        return llguidance.LLTokenizer(self._raw.to_str(), n_vocab=self.vocab_size)


def template_kwargs_clash(kwargs: dict[str, Any]) -> list[str]:
    """The chat_template_kwargs that would set what render_chat itself passes the template
    (the messages, the tools): none may."""
    return sorted(set(kwargs) & set(_RENDER_ARGUMENTS))


def _reads_variable(source: str | None, name: str) -> bool:
    """Whether a template reads the top-level variable `name` (Jinja's own analysis)."""
    if not source:
        return False
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    return name in jinja2.meta.find_undeclared_variables(env.parse(source))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_ids(value: Any) -> tuple[int, ...]:
    """A generation config's eos_token_id: one id, a list of them, or none."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _token_text(value: str | dict) -> str:
    return value["content"] if isinstance(value, dict) else value


def _is_token(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and "content" in value)


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens transformers hands a chat template (its special_tokens_map): the
    named ones, then any other `*_token` string of the config or of a dict of
    extra_special_tokens (model-specific tokens such as Gemma 3's `image_token`)."""
    tokens = {k: _token_text(config[k]) for k in _SPECIAL_KEYS if _is_token(config.get(k))}
    for key, value in config.items():
        if key.endswith("_token") and key not in tokens and _is_token(value):
            tokens[key] = _token_text(value)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: _token_text(v) for k, v in extra.items() if _is_token(v)})
    return tokens


def _read_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (as transformers
    reads them), else a processor's chat_template.json (multimodal model folders)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def _left_open(rendered: str, final: dict[str, Any]) -> str:
    """The rendering cut right after the last message's text, so the model continues it
    (transformers' continue_final_message: its text, or stripped, found last)."""
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise ValueError("only a last assistant message with text can be continued")
    for text in (content, content.strip()):
        end = rendered.rfind(text)
        if text and end >= 0:
            return rendered[: end + len(text)]
    raise ValueError("the chat template does not render the last message's text as it is")


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to the template: keys whose value is None
    dropped (templates handle a missing key, not a None), and a message's reasoning
    under `reasoning_content` and `thinking` whatever name it came under."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which marks the assistant's text for
    transformers' assistant-token masks: rendered as its body, as transformers does."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """The template's `dict`: builds dicts, but exposes nothing of the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The template's `namespace`, refusing underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def _compile_template(source: str) -> Any:
    """The Jinja environment transformers renders chat templates in
    (transformers/utils/chat_template_utils.py, _compile_jinja_template)."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # a few tokens of context so merges decode right
        self._read_offset = 0  # ids before this are already emitted as text

    def add(self, token_id: int) -> str:
        """Append a token; return the new text that is now complete (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence (or nothing visible) so far
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """The text still held back at the end of generation (even if not valid UTF-8)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, self._skip)
