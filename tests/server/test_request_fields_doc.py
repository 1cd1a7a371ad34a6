"""docs/serving.md's "Request fields" section names every field the chat and completions
routes take, and exactly the fields they refuse: a field added or refused in the code and
not in the docs fails here."""

from __future__ import annotations

import re

from pydantic import BaseModel
from tests_root import ROOT as ROOT_DIR

from appliance.server.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

SERVING = ROOT_DIR / "docs" / "serving.md"


def section() -> str:
    text = SERVING.read_text()
    start = text.index("## Request fields\n")
    return text[start : text.index("### Sampling controls and logprobs", start)]


def field_names(model: type[BaseModel]) -> set[str]:
    """The names a client sends: a field's alias where it has one (`json`, `schema`)."""
    return {info.alias or name for name, info in model.model_fields.items()}


def table_names() -> set[str]:
    rows = [line for line in section().splitlines() if line.startswith("| `")]
    # A name may hold a dot: llama.cpp's flat `speculative.n_max`.
    return {name for row in rows for name in re.findall(r"`([\w.]+)`", row.split("|")[1])}


def refused_names() -> set[str]:
    paragraph = section().split("Refused, not ignored", 1)[1].split("\n\n", 1)[0]
    # Only the names before each parenthesis: "(send `tools`)" is advice, not a field.
    return set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", paragraph)))


def test_every_field_the_routes_take_is_in_the_table() -> None:
    taken = field_names(ChatCompletionRequest) | field_names(CompletionRequest)
    assert taken - table_names() == set()


def test_the_table_names_no_field_the_routes_do_not_take() -> None:
    taken = field_names(ChatCompletionRequest) | field_names(CompletionRequest)
    assert table_names() - taken == set()


def test_the_refused_list_is_the_servers() -> None:
    assert refused_names() == set(UNSUPPORTED_FIELDS)
