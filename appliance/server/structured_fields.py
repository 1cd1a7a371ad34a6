"""The request fields that ask for a structured output, under every spelling clients use:
OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
{json, regex, choice, grammar} and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` (with `guided_whitespace_pattern` for a JSON output's
whitespace). Each becomes one StructuredOutput, compiled here, in the server process,
before the request is submitted: a spec the grammar engine cannot compile is a 400 that
names the field and what is unsupported."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from appliance.engine.sequence import StructuredOutput
from appliance.engine.structured.compile import UnsupportedSpec, check
from appliance.server.errors import APIError

# A JSON schema arrives as an object; vLLM's fields also take it as JSON text.
Schema = dict[str, Any] | bool


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema; `strict` is always in force here."""

    name: str = Field(max_length=64)
    schema_: Schema | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), any JSON object, or a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of its fields."""

    json_: Schema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The structured-output fields of a chat or text completion request; at most one of
    them may ask for a constraint. `structured_output()` is the checked spec."""

    model_config = ConfigDict(strict=True, extra="ignore")

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # llama.cpp server's own spellings: a JSON schema, and a GBNF grammar ("" is off)
    json_schema: Schema | None = None
    grammar: str | None = None
    # vLLM's: a regex of the whitespace a JSON output may hold between its tokens
    guided_whitespace_pattern: str | None = None
    _spec: StructuredOutput | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _compiles(self) -> StructuredFields:
        # An APIError is no ValueError: pydantic passes it on as it is (a 400, not a 422).
        asked = self._asked()
        if len(asked) > 1:
            names = ", ".join(field for field, _ in asked)
            raise APIError(
                400, f"only one structured output may be asked for, got {names}", asked[1][0]
            )
        if asked:
            field, spec = asked[0]
            _checked(field, spec)
            if self.guided_whitespace_pattern is not None:
                spec = _with_whitespace(spec, self.guided_whitespace_pattern)
            self._spec = spec
        elif self.guided_whitespace_pattern is not None:
            _with_whitespace(None, self.guided_whitespace_pattern)  # refused: no JSON
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint as plain data for the workers (None: free text)."""
        return self._spec

    def _asked(self) -> list[tuple[str, StructuredOutput]]:
        """(the field it came in, its spec) for every field that asks for a constraint."""
        asked = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                asked.append(("response_format", spec))
        if self.structured_outputs is not None:
            asked += [
                (f"structured_outputs.{name}", spec)
                for name, spec in _vllm_specs(self.structured_outputs)
            ]
        legacy = StructuredOutputs(
            json=self.guided_json,
            regex=self.guided_regex,
            choice=self.guided_choice,
            grammar=self.guided_grammar,
        )
        asked += [(f"guided_{name}", spec) for name, spec in _vllm_specs(legacy)]
        llama_cpp = StructuredOutputs(json=self.json_schema, grammar=self.grammar or None)
        names = {"json": "json_schema", "grammar": "grammar"}
        asked += [(names[name], spec) for name, spec in _vllm_specs(llama_cpp)]
        return asked


def _checked(field: str, spec: StructuredOutput) -> None:
    """`spec` compiled as the workers will build it; a 400 naming `field` otherwise."""
    try:
        check(spec)
    except UnsupportedSpec as exc:
        raise APIError(400, f"{field}: unsupported: {exc}", field, "unsupported") from None
    except UnicodeEncodeError:  # JSON can carry "\ud800", which no text holds
        raise APIError(400, f"{field} holds a lone surrogate: no text", field) from None


def _with_whitespace(spec: StructuredOutput | None, pattern: str) -> StructuredOutput:
    """A JSON spec with guided_whitespace_pattern's whitespace, checked; a 400 naming the
    field for an empty pattern, one that does not compile, or no JSON output to apply to."""
    field = "guided_whitespace_pattern"
    if spec is None or spec.kind not in ("json", "json_object"):
        message = f"{field} applies to a JSON output (guided_json, response_format, ...)"
        raise APIError(400, message, field)
    if not pattern:
        raise APIError(400, f"{field} is empty: leave it out for compact JSON", field)
    spaced = replace(spec, whitespace=pattern)
    _checked(field, spaced)
    return spaced


def _response_format(value: ResponseFormat) -> StructuredOutput | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return StructuredOutput("json_object")
    if value.json_schema is None:
        raise APIError(
            400,
            "response_format.json_schema is required when type is json_schema",
            "response_format.json_schema",
        )
    schema = value.json_schema.schema_
    # OpenAI takes a json_schema without a schema: any JSON value then.
    return StructuredOutput("json", json.dumps({} if schema is None else schema))


def _vllm_specs(value: StructuredOutputs) -> list[tuple[str, StructuredOutput]]:
    """Each constraint vLLM's fields ask for, by its field name."""
    specs = []
    if value.json_ is not None:
        text = value.json_ if isinstance(value.json_, str) else json.dumps(value.json_)
        specs.append(("json", StructuredOutput("json", text)))
    if value.regex is not None:
        specs.append(("regex", StructuredOutput("regex", value.regex)))
    if value.choice is not None:
        specs.append(("choice", StructuredOutput("choice", json.dumps(value.choice))))
    if value.grammar is not None:
        specs.append(("grammar", StructuredOutput("grammar", value.grammar)))
    if value.json_object:
        specs.append(("json_object", StructuredOutput("json_object")))
    return specs
