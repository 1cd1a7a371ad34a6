"""Tool calls read out of JSON text as it streams in: each call's name as soon as its
string closes, its arguments as raw fragments while they are written.

A call is a JSON object `{"name": ..., "arguments": {...}}` ("parameters" is read as
"arguments", as Llama 3 writes it) found at a fixed nesting depth: 0 for bare objects
(Qwen's `<tool_call>` bodies, Llama 3's JSON, one after another), 1 for an array of calls
(Mistral's `[TOOL_CALLS]`, Phi-4-mini's `functools[...]`, the constrained `required`
output), 2 for the generic format's `{"tool_calls": [...]}`. Text outside any JSON value
(tags such as `</tool_call>`, separators) is skipped. The generic format's reply,
`{"response": "..."}`, streams as text through `text_key`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from appliance.chat.chat_delta import CallDelta, ChatDelta

ARGUMENT_KEYS = ("arguments", "parameters")
# An escape at the end of a string's text that more characters will finish: after an even
# run of backslashes (odd ones escape each other), a lone backslash, a partial \uXXXX, or a
# high surrogate whose low half has not come.
_OPEN_ESCAPE = re.compile(
    r"(?<!\\)(?:\\\\)*(?P<escape>\\(?:u[0-9a-fA-F]{0,3})?|\\u[dD][89abAB][0-9a-fA-F]{2}"
    r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?)$"
)


@dataclass
class _Frame:
    """One open JSON container."""

    kind: str  # "{" or "["
    is_call: bool = False
    key: str | None = None  # the key whose value comes next (objects)
    expect_key: bool = True


@dataclass
class _Call:
    index: int
    name: str | None = None
    named: bool = False  # its name was yielded
    pending: list[str] = field(default_factory=list)  # arguments written before the name
    string_arguments: bool = False  # "arguments": "{...}" (JSON text in a string)
    raw: list[str] = field(default_factory=list)  # all argument text, as written


class JsonCallScanner:
    """Feed text; get the calls' names and argument fragments as they complete."""

    def __init__(self, call_depth: int, text_key: str | None = None) -> None:
        self._call_depth = call_depth
        self._text_key = text_key
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escape = False
        self._string: list[str] = []  # the open string's raw characters
        self._string_role = ""  # "key", "name", "arguments", "text" or "" (ignored)
        self._text_sent = 0  # characters of the text string already yielded
        self._capture_depth: int | None = None  # stack depth of the call whose args stream
        self._awaiting: str = ""  # "name", "arguments" or "text": the next value is that
        self.calls: list[_Call] = []
        self._call: _Call | None = None
        self.saw_text = False  # a `text_key` string began

    @property
    def complete(self) -> bool:
        """Whether every JSON value opened so far was closed."""
        return not self._stack and not self._in_string

    def feed(self, text: str) -> ChatDelta:
        out = ChatDelta()
        for char in text:
            self._step(char, out)
        if self._string_role == "text":
            out.content += self._text_progress()
        return out

    # ------------------------------------------------------------------ characters

    def _step(self, char: str, out: ChatDelta) -> None:
        if self._in_string:
            self._string_char(char, out)
            return
        if self._capture_depth is not None:
            if not self._value_char(char, out):
                return
        if char.isspace():
            return
        if self._awaiting and self._awaiting != "arguments" and char != '"':
            self._awaiting = ""  # the name or text is no string: ignore it
        if char == '"':
            self._open_string()
        elif char in "{[":
            self._open(char)
        elif char in "}]":
            self._close(out)
        elif char == ":" and self._stack:
            self._colon()
        elif char == "," and self._stack and self._stack[-1].kind == "{":
            self._stack[-1].expect_key = True
            self._stack[-1].key = None

    def _value_char(self, char: str, out: ChatDelta) -> bool:
        """A character of a call's arguments value; False when it was consumed."""
        call = self._call
        assert call is not None and self._capture_depth is not None
        at_call_level = len(self._stack) == self._capture_depth
        if at_call_level and char in ",}" and call.raw:
            self._capture_depth = None  # a number or literal ended: the call goes on
            return True
        if at_call_level and not call.raw and char.isspace():
            return False
        self._emit_arguments(char, out)
        if char == '"':
            self._in_string = True
            self._string_role = "arguments"
            self._string = []
            if at_call_level:
                call.string_arguments = True
        elif char in "{[":
            self._stack.append(_Frame(char, expect_key=char == "{"))
        elif char in "}]":
            self._stack.pop()
            if len(self._stack) == self._capture_depth:
                self._capture_depth = None
        elif char == ":" and self._stack[-1].kind == "{":
            self._stack[-1].expect_key = False
        elif char == "," and self._stack[-1].kind == "{":
            self._stack[-1].expect_key = True
        return False

    def _string_char(self, char: str, out: ChatDelta) -> None:
        if self._string_role == "arguments":
            self._emit_arguments(char, out)
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._close_string(out)
            return
        self._string.append(char)

    def _open_string(self) -> None:
        self._in_string = True
        self._string = []
        top = self._stack[-1] if self._stack else None
        if top is not None and top.kind == "{" and top.expect_key:
            self._string_role = "key"
        else:
            self._string_role = self._awaiting if self._awaiting in ("name", "text") else ""
            self._text_sent = 0
            self.saw_text = self.saw_text or self._string_role == "text"
        self._awaiting = ""

    def _close_string(self, out: ChatDelta) -> None:
        self._in_string = False
        role, raw = self._string_role, "".join(self._string)
        self._string_role = ""
        if role == "key":
            self._stack[-1].key = _decode(raw)
            self._stack[-1].expect_key = False
        elif role == "name" and self._call is not None:
            self._call.name = _decode(raw)
            self._name_call(out)
        elif role == "text":
            out.content += self._text_progress(raw, closed=True)
        elif role == "arguments" and len(self._stack) == self._capture_depth:
            self._capture_depth = None  # "arguments": "..." ended

    def _open(self, kind: str) -> None:
        is_call = kind == "{" and len(self._stack) == self._call_depth
        self._stack.append(_Frame(kind, is_call=is_call))
        self._awaiting = ""
        if is_call:
            self._call = _Call(len(self.calls))
            self.calls.append(self._call)

    def _close(self, out: ChatDelta) -> None:
        if not self._stack:
            return  # a stray bracket outside any value: not ours to judge
        frame = self._stack.pop()
        if frame.is_call and self._call is not None:
            if not self._call.named and self._call.name is not None:
                self._name_call(out)
            self._call = None

    def _colon(self) -> None:
        top = self._stack[-1]
        if top.kind != "{":
            return
        top.expect_key = False
        key = top.key
        if top.is_call and key == "name":
            self._awaiting = "name"
        elif top.is_call and key in ARGUMENT_KEYS:
            self._awaiting = "arguments"
            self._capture_depth = len(self._stack)
        elif key == self._text_key and len(self._stack) == 1:
            self._awaiting = "text"

    # ------------------------------------------------------------------ output

    def _name_call(self, out: ChatDelta) -> None:
        call = self._call
        assert call is not None
        call.named = True
        out.calls.append(CallDelta(call.index, name=call.name))
        if call.pending and not call.string_arguments:
            out.calls.append(CallDelta(call.index, arguments="".join(call.pending)))
        call.pending = []

    def _emit_arguments(self, char: str, out: ChatDelta) -> None:
        call = self._call
        assert call is not None
        call.raw.append(char)
        if not call.named or call.string_arguments or (not call.raw[:-1] and char == '"'):
            call.pending.append(char)
            return
        if out.calls and out.calls[-1].index == call.index and out.calls[-1].name is None:
            out.calls[-1].arguments += char
        else:
            out.calls.append(CallDelta(call.index, arguments=char))

    def _text_progress(self, raw: str | None = None, closed: bool = False) -> str:
        """The text string's characters not yet yielded, decoded (an escape cut in half
        waits for the rest)."""
        raw = "".join(self._string) if raw is None else raw
        if not closed:
            raw = _complete_escapes(raw)
        text = _decode(raw)
        new = text[self._text_sent :]
        self._text_sent = len(text)
        return new

    def arguments(self, call: _Call) -> str:
        """A call's whole arguments as JSON text ("{}" when it wrote none)."""
        raw = "".join(call.raw).strip()
        if call.string_arguments:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                return raw
            return value if isinstance(value, str) else json.dumps(value)
        return raw or "{}"

    def string_argument_deltas(self) -> list[CallDelta]:
        """The arguments of calls that wrote them as a JSON string, decoded, at the end."""
        return [
            CallDelta(c.index, arguments=self.arguments(c))
            for c in self.calls
            if c.named and c.string_arguments
        ]


def _decode(raw: str) -> str:
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw


def _complete_escapes(raw: str) -> str:
    """`raw` without a trailing escape sequence that is not finished yet (a lone `\\`,
    a `\\u` with fewer than four digits, or the first half of a surrogate pair)."""
    match = _OPEN_ESCAPE.search(raw)
    return raw[: match.start("escape")] if match else raw
