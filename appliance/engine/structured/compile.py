"""A StructuredOutput (plain data) -> an llguidance grammar, and the check a server runs
before it submits a request: a spec the engine cannot compile is refused with a message
that names what is unsupported. Torch-free: the server process runs it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

from appliance.engine.sequence import StructuredOutput

# Compact JSON with the spaces models write after ", " and ": ", and no free whitespace:
# free whitespace lets a small model emit newlines until max_tokens (vLLM's llguidance
# backend turns it off too).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class UnsupportedSpec(ValueError):
    """A structured-output spec the grammar engine cannot compile; the message says what."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for a spec; raises UnsupportedSpec for one
    that is not even well formed (not JSON, a choice that is no list of strings)."""
    match spec.kind:
        case "json":
            return _json_schema(_parse_json(spec.spec, "a JSON schema"))
        case "json_object":
            return _json_schema({"type": "object"})
        case "regex":
            if not spec.spec:
                raise UnsupportedSpec("the regular expression is empty")
            return str(llguidance.LLMatcher.grammar_from_regex(spec.spec))
        case "choice":
            choices = _parse_json(spec.spec, "a list of choices")
            if not (isinstance(choices, list) and choices) or not all(
                isinstance(c, str) for c in choices
            ):
                raise UnsupportedSpec("choices must be a non-empty list of strings")
            return str(llguidance.grammar_from("choice", json.dumps(choices)))
        case "grammar":
            try:  # Lark, or GBNF (llama.cpp's) converted to Lark
                return str(llguidance.grammar_from("grammar", spec.spec))
            except ValueError as exc:
                raise UnsupportedSpec(str(exc)) from None
    raise UnsupportedSpec(f"unknown structured output kind {spec.kind!r}")


def check(spec: StructuredOutput) -> str:
    """Compile-check a spec as the workers will build it; returns its grammar. Raises
    UnsupportedSpec naming what llguidance refuses (an unimplemented schema keyword, a
    bad regex, a grammar syntax error)."""
    grammar = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise UnsupportedSpec(_first_line(messages[0]) if messages else "it does not compile")
    return grammar


def _json_schema(schema: Any) -> str:
    if schema is True:
        schema = {}  # any JSON value
    if not isinstance(schema, dict):
        raise UnsupportedSpec("a JSON schema must be an object (or true)")
    try:
        text = json.dumps(_calendar_dates(schema))
        return str(llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS))
    except ValueError as exc:
        raise UnsupportedSpec(_first_line(str(exc))) from None


# A calendar date with no February 29th: llguidance's `format: date` allows Feb 29 of any
# year (2761-02-29 was sampled), which is no date in a common year. This subset is valid
# in every year (and has no year 0000, which is none either); a leap day is never produced
# (a regular language tells leap years apart only by a long alternation of years).
VALID_DATE = (
    r"^(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))$"
)


def _calendar_dates(schema: Any) -> Any:
    """The schema with each `format: date` string (without a pattern of its own) held to
    VALID_DATE instead."""
    if isinstance(schema, list):
        return [_calendar_dates(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {key: _calendar_dates(value) for key, value in schema.items()}
    if found.get("format") == "date" and "pattern" not in found:
        del found["format"]
        found["pattern"] = VALID_DATE
    return found


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnsupportedSpec(f"{what} must be JSON: {exc}") from None


def _first_line(message: str) -> str:
    """llguidance's message without its multi-line detail, but with the reason a regex
    parser puts on a line of its own ("error: unclosed group")."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return message
    reason = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {reason}".strip()
