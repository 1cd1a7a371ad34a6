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
            return _json_schema(_parse_json(spec.spec, "a JSON schema"), spec.whitespace)
        case "json_object":
            return _json_schema({"type": "object"}, spec.whitespace)
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


def _json_schema(schema: Any, whitespace: str = "") -> str:
    """A JSON schema's grammar: compact (JSON_OPTIONS), or with `whitespace` (a regex)
    wherever JSON allows whitespace, as outlines reads vLLM's guided_whitespace_pattern."""
    if schema is True:
        schema = {}  # any JSON value
    if not isinstance(schema, dict):
        raise UnsupportedSpec("a JSON schema must be an object (or true)")
    options = JSON_OPTIONS
    if whitespace:
        options = {
            "whitespace_flexible": True,
            "whitespace_pattern": whitespace,
            "item_separator": ",",
            "key_separator": ":",
        }
    try:
        text = json.dumps(_narrowed(schema))
        return str(llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options))
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


# A number's digits, bounded as llama.cpp's schema grammars bound them: a small model at
# temperature 1 wrote a fraction of hundreds of digits until max_tokens cut the document
# (0.000102089999...). 15 integral digits (what a double holds exactly: llguidance reads
# bounds as doubles, and 10**16 - 1 is read as 10**16) and 10 fraction digits (llguidance
# drops every number for a multipleOf of 1e-11 or finer).
MAX_MAGNITUDE = 10**15 - 1
FRACTION_STEP = 1e-10
# Keywords whose values are data, never schemas: nothing in them is narrowed.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _narrowed(schema: Any) -> Any:
    """The schema with what a sampled document may hold narrowed, never widened: every
    document the grammar allows still validates against the caller's schema.

    A `format: date` string (without a pattern of its own) is held to VALID_DATE; a number
    or integer without bounds (nor a const or enum) of its own to MAX_MAGNITUDE, a number
    without a multipleOf of its own to FRACTION_STEP."""
    if isinstance(schema, list):
        return [_narrowed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {
        key: value if key in DATA_KEYWORDS else _narrowed(value) for key, value in schema.items()
    }
    if found.get("format") == "date" and "pattern" not in found:
        del found["format"]
        found["pattern"] = VALID_DATE
    types = found.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "const" in found or "enum" in found:
        types = set()  # its values bound it already, and might lie outside our bounds
    if "number" in types and "multipleOf" not in found:
        found["multipleOf"] = FRACTION_STEP
    if types & {"number", "integer"}:
        _bound(found, ("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum"), 1)
        _bound(found, ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"), -1)
    return found


def _bound(
    schema: dict[str, Any], side: tuple[str, str], other: tuple[str, str], sign: int
) -> None:
    """Set schema[side[0]] to sign * MAX_MAGNITUDE where the schema bounds neither keyword
    of that side and no bound on the other side lies beyond it (which would leave no
    number at all)."""
    if any(key in schema for key in side):
        return
    for key in other:
        value = schema.get(key)
        if isinstance(value, int | float) and sign * value >= MAX_MAGNITUDE:
            return
    schema[side[0]] = sign * MAX_MAGNITUDE


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
