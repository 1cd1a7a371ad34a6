"""The grammar engine's parts on the embedded model's real tokenizer (SmolLM2, 49,152
tokens), in process: compiling specs and naming what is unsupported, a matcher rebuilt
from plain data and replayed equals one that followed the tokens live, masks applied to
a batch of logits, the sampler drawing whole documents through them, and a re-run that
carries its streamed tokens' count."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import llguidance
import pytest
import torch
from mask_rows import Row
from tests_root import DATA

from appliance.core.request_table import RequestTable
from appliance.engine.sampling.sampler import Sampler, SampleRow
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.structured import masks as masks_module
from appliance.engine.structured.compile import UnsupportedSpec, check
from appliance.engine.structured.masks import GrammarMasks, apply_grammar, unpack
from appliance.engine.structured.matcher import RequestMatcher
from appliance.engine.structured.vocabulary import grammar_vocabulary
from appliance.model.model_source import prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

SCHEMAS: dict[str, dict[str, Any]] = json.loads((DATA / "json_schemas.json").read_text())
PERSON = SCHEMAS["flat_person"]
PROMPT = [1, 2, 3, 4]  # any ids: a matcher never reads the prompt


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return prepare_tokenizer(None, load_settings().cache_dir)[1]


@pytest.fixture(scope="module", autouse=True)
def vocabulary_built_once() -> Iterator[None]:
    """Each GrammarMasks builds llguidance's view of the tokenizer at its first matcher
    (~0.3 s for 49,152 tokens); this module's half dozen share the one they would each
    build alike, as a worker's requests do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masks_module, "grammar_vocabulary", functools.cache(grammar_vocabulary))
        yield


@pytest.fixture(scope="module")
def masks(tokenizer: Tokenizer) -> GrammarMasks:
    return GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)


def constrained(kind: str, spec: Any = "", **more: Any) -> SamplingParams:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return SamplingParams(structured=StructuredOutput(kind, text), **more)


def allowed(masks: GrammarMasks, row: Row) -> set[int]:
    logits = torch.zeros(1, masks.vocab_size)
    masks.apply(logits, [row])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def text_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


# ------------------------------------------------------------------ compile


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_of_the_set_compiles(name: str) -> None:
    check(StructuredOutput("json", json.dumps(SCHEMAS[name])))


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (
            StructuredOutput("json", '{"type": "object", "dependentRequired": {}}'),
            "dependentRequired",
        ),
        (StructuredOutput("json", '{"type": "string", "format": "zodiac"}'), "zodiac"),
        (StructuredOutput("json", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
        (StructuredOutput("json", "{not json"), "must be JSON"),
        (StructuredOutput("json", "[1, 2]"), "must be an object"),
        (StructuredOutput("regex", "(a"), "unclosed group"),
        (StructuredOutput("regex", ""), "empty"),
        (StructuredOutput("choice", '["a", 1]'), "list of strings"),
        (StructuredOutput("choice", "[]"), "non-empty"),
        (StructuredOutput("grammar", "root ::= missing"), "missing"),
        (StructuredOutput("grammar", "start: nowhere"), "nowhere"),
    ],
)
def test_what_cannot_compile_is_named(spec: StructuredOutput, named: str) -> None:
    with pytest.raises(UnsupportedSpec, match=named):
        check(spec)


def test_each_kind_compiles() -> None:
    for spec in (
        StructuredOutput("json_object"),
        StructuredOutput("json", "true"),
        StructuredOutput("regex", "[0-9]{3}"),
        StructuredOutput("choice", '["yes", "no"]'),
        StructuredOutput("grammar", 'root ::= "yes" | "no"'),  # GBNF
        StructuredOutput("grammar", 'start: "yes" | "no"'),  # Lark
    ):
        assert check(spec)


@pytest.mark.parametrize(
    ("whitespace", "matches"),
    [
        ("", [True, False, False, False]),  # compact: the spaces models write, no other
        ("[ ]?", [True, True, True, False]),  # at most one space where JSON allows any
        (r"[ \n]*", [True, True, True, True]),
    ],
)
def test_a_whitespace_pattern_is_where_json_allows_whitespace(
    tokenizer: Tokenizer, whitespace: str, matches: list[bool]
) -> None:
    """vLLM's guided_whitespace_pattern, as outlines reads it: the pattern between the
    JSON's tokens in place of the compact default."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    grammar = check(StructuredOutput("json", json.dumps(schema), whitespace))
    texts = ['{"a": 1, "b": "x"}', '{ "a" : 1 , "b" : "x" }', '{"a":1,"b":"x"}']
    texts.append('{\n  "a": 1,\n  "b": "x"\n}')
    vocabulary = grammar_vocabulary(tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids)
    got = []
    for text in texts:
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        got.append(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())
    assert got == matches
    with pytest.raises(ValueError, match="applies to JSON"):
        StructuredOutput("regex", "[0-9]+", "[ ]?")


# ------------------------------------------------------------------ matcher


def test_a_replayed_matcher_equals_one_that_followed_live(
    masks: GrammarMasks, tokenizer: Tokenizer
) -> None:
    """What a decode worker (or a re-run) rebuilds from plain data allows exactly what the
    worker that sampled the tokens one by one allows, at every step."""
    params = constrained("json", PERSON)
    output = text_tokens(tokenizer, '{"name": "Ada", "age": 36}')
    live = RequestMatcher(params.structured, masks.vocabulary, len(PROMPT))  # type: ignore[arg-type]
    for n in range(len(output) + 1):
        tokens = PROMPT + output[:n]
        live.catch_up(tokens)
        row = Row(100 + n, params, tokens, len(PROMPT))  # a new id: built and replayed
        assert allowed(masks, row) == _allowed_by(live, masks)
        masks.forget(row.seq_id)
    assert live.complete


def _allowed_by(matcher: RequestMatcher, masks: GrammarMasks) -> set[int]:
    bitmask = torch.empty(1, masks.words, dtype=torch.int32)
    matcher.fill(bitmask.data_ptr(), masks.words * 4)
    return set(unpack(bitmask, masks.vocab_size)[0].nonzero().flatten().tolist())


def test_a_rerun_prompt_replays_its_emitted_tokens(
    masks: GrammarMasks, tokenizer: Tokenizer
) -> None:
    """A re-run's prompt ends with what it streamed: with `emitted` counting those, its
    matcher stands where the first attempt's stood."""
    spec = StructuredOutput("json", json.dumps(PERSON))
    streamed = text_tokens(tokenizer, '{"name": "Ada", "ag')
    first = Row(1, SamplingParams(structured=spec), PROMPT + streamed, len(PROMPT))
    folded = SamplingParams(structured=spec, emitted=len(streamed))
    rerun = Row(2, folded, PROMPT + streamed, len(PROMPT + streamed))
    fresh = Row(3, SamplingParams(structured=spec), PROMPT + streamed, len(PROMPT + streamed))
    assert allowed(masks, rerun) == allowed(masks, first) != allowed(masks, fresh)
    for seq_id in (1, 2, 3):
        masks.forget(seq_id)


def test_the_request_table_counts_a_reruns_emitted_tokens() -> None:
    table = RequestTable()
    params = constrained("json", PERSON, max_tokens=50)
    request = table.add([1, 2, 3], params, 0.0)
    table.submit(request.request_id, 0)
    request.output_ids = [7, 8, 9]  # streamed before its worker was lost
    table.rerun(request.request_id)
    assert request.attempt_params.structured == StructuredOutput("json", json.dumps(PERSON))
    assert request.attempt_params.emitted == 3
    assert request.attempt_params.max_tokens == 47
    assert request.tokens == [1, 2, 3, 7, 8, 9]


def test_a_token_the_grammar_refuses_leaves_only_end_tokens(
    masks: GrammarMasks, tokenizer: Tokenizer
) -> None:
    """A worker never fails a step on it (an end token sampled under ignore_eos goes past
    the document's end): the request may only end from there."""
    row = Row(6, constrained("regex", "[0-9]+"), PROMPT + text_tokens(tokenizer, "abc"), 4)
    assert allowed(masks, row) == set(tokenizer.stop_token_ids)
    assert masks._matchers[6].refused
    masks.forget(6)


@pytest.mark.parametrize(
    "spec", [StructuredOutput("regex", "(a"), StructuredOutput("json", "{not json")]
)
def test_a_spec_no_matcher_can_be_built_for_ends_the_request(
    masks: GrammarMasks, tokenizer: Tokenizer, spec: StructuredOutput
) -> None:
    """Only a caller that skipped the server's check sends one: the worker's step goes on,
    and that request can only end."""
    row = Row(8, SamplingParams(structured=spec), PROMPT, len(PROMPT))
    assert allowed(masks, row) == set(tokenizer.stop_token_ids)
    assert masks._matchers[8].refused
    masks.forget(8)


def test_a_complete_grammar_allows_only_the_end_tokens(
    masks: GrammarMasks, tokenizer: Tokenizer
) -> None:
    tokens = PROMPT + text_tokens(tokenizer, "yes")
    row = Row(5, constrained("choice", ["yes", "no"]), tokens, len(PROMPT))
    assert allowed(masks, row) == set(tokenizer.stop_token_ids)
    masks.forget(5)


# ------------------------------------------------------------------ masks


def test_masks_apply_to_structured_rows_only(masks: GrammarMasks, tokenizer: Tokenizer) -> None:
    logits = torch.randn(3, masks.vocab_size)
    rows = [
        Row(10, constrained("choice", ["yes", "no"]), PROMPT, len(PROMPT)),
        Row(11, SamplingParams(), PROMPT, len(PROMPT)),
        Row(12, constrained("regex", "[0-9]{2}"), PROMPT, len(PROMPT)),
    ]
    before = logits.clone()
    masks.apply(logits, rows)
    assert torch.equal(logits[1], before[1])
    for i in (0, 2):
        kept = torch.isfinite(logits[i])
        assert torch.equal(logits[i][kept], before[i][kept])
    first = {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert "yes" in first and "no" in first and "maybe" not in first
    digits = [tokenizer.decode([t]) for t in torch.isfinite(logits[2]).nonzero().flatten().tolist()]
    assert digits and all(d.isdigit() and len(d) <= 2 for d in digits)
    for seq_id in (10, 11, 12):
        masks.forget(seq_id)


def test_masks_computed_in_the_background_equal_those_computed_inline(
    tokenizer: Tokenizer,
) -> None:
    background = GrammarMasks(tokenizer, tokenizer.vocab_size, background=True)
    inline = GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)
    params = constrained("json", SCHEMAS["array_of_objects"])
    tokens = PROMPT + text_tokens(tokenizer, '{"items": [{"sku": "AB')
    rows = [Row(1, params, tokens, len(PROMPT)), Row(2, SamplingParams(), tokens, len(PROMPT))]
    background.start(rows)
    assert background._pending is not None  # it did start on the thread
    one, two = torch.randn(2, tokenizer.vocab_size), None
    two = one.clone()
    background.apply(one, rows)
    inline.apply(two, rows)
    assert torch.equal(one, two) and not torch.isfinite(one[0]).all()
    background.close()


def test_forget_drops_the_matcher(tokenizer: Tokenizer) -> None:
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)
    row = Row(7, constrained("json_object"), PROMPT, len(PROMPT))
    masks.apply(torch.zeros(1, masks.vocab_size), [row])
    assert 7 in masks._matchers
    masks.forget(7)
    assert 7 not in masks._matchers


def test_unpack_reads_bit_t_of_word_t_over_32() -> None:
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    assert unpack(bitmask, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert unpack(bitmask, 40).shape == (1, 40)


def test_a_sampler_without_masks_refuses_a_structured_row() -> None:
    row = Row(1, constrained("json_object"), PROMPT, len(PROMPT))
    with pytest.raises(ValueError, match="grammar masks"):
        apply_grammar(None, torch.zeros(1, 8), [row])
    apply_grammar(None, torch.zeros(1, 8), [Row(2, SamplingParams(), PROMPT, 4)])


@pytest.mark.parametrize("name", ["nested_address", "any_of_shapes", "formats_network", "matrix"])
def test_the_sampler_draws_valid_documents_from_random_logits(
    tokenizer: Tokenizer, name: str
) -> None:
    """Whatever the model's logits, the documents sampled through the masks validate: here
    noise stands in for the model, temperature 1, three rows in one batch."""
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=True)
    sampler = Sampler(torch.device("cpu"))
    sampler.grammar = masks
    schema = SCHEMAS[name]
    params = constrained("json", schema, temperature=1.0, seed=3)
    ends = tokenizer.stop_token_ids
    seqs = {i: list(PROMPT) for i in range(3)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        live = [i for i, s in seqs.items() if s[-1] not in ends]
        if not live:
            break
        rows = [SampleRow(i, params, seqs[i], len(PROMPT), ends) for i in live]
        masks.start(rows)
        logits = torch.randn(len(rows), tokenizer.vocab_size, generator=gen) * 3
        for i, token in zip(live, sampler.sample(logits, rows).token_ids, strict=True):
            seqs[i].append(token)
    for tokens in seqs.values():
        assert tokens[-1] in ends, "every row ends with an end token"
        document = json.loads(tokenizer.decode(tokens[len(PROMPT) : -1]))
        jsonschema.validate(document, schema, format_checker=jsonschema.FormatChecker())
    masks.close()


def test_masks_started_for_other_rows_are_recomputed(tokenizer: Tokenizer) -> None:
    """The sampler's rows differ from those started (another order): the mask is computed
    for the rows given, never taken from the wrong ones."""
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=True)
    digits = Row(1, constrained("regex", "[0-9]+"), PROMPT, len(PROMPT))
    words = Row(2, constrained("regex", "[a-z]+"), PROMPT, len(PROMPT))
    masks.start([digits, words])
    logits = torch.zeros(2, tokenizer.vocab_size)
    masks.apply(logits, [words, digits])
    first = [tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero()[:, 0].tolist()]
    second = [tokenizer.decode([t]) for t in torch.isfinite(logits[1]).nonzero()[:, 0].tolist()]
    assert first and all(t.isalpha() and t.islower() for t in first)
    assert second and all(t.isdigit() for t in second)
    masks.close()


def test_a_date_the_grammar_allows_is_a_calendar_date() -> None:
    """llguidance's `format: date` let 2761-02-29 through (no leap year): dates are held to
    a subset that is a date in every year, as jsonschema's format checker reads dates."""
    import re

    from jsonschema import FormatChecker

    from appliance.engine.structured.compile import VALID_DATE, _narrowed

    schema = {"type": "object", "properties": {"born": {"type": "string", "format": "date"}}}
    assert _narrowed(schema)["properties"]["born"] == {
        "type": "string",
        "pattern": VALID_DATE,
    }
    checker = FormatChecker()
    for year in (0, 1, 1900, 2000, 2024, 2761, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                if re.fullmatch(VALID_DATE, text):
                    assert checker.conforms(text, "date"), text
    assert not re.fullmatch(VALID_DATE, "2761-02-29")
    assert re.fullmatch(VALID_DATE, "2761-02-28") and re.fullmatch(VALID_DATE, "2024-12-31")


def _takes(masks: GrammarMasks, tokenizer: Tokenizer, schema: dict[str, Any], text: str) -> bool:
    """Whether the schema's matcher takes `text` (one character a token) and may end there."""
    matcher = RequestMatcher(StructuredOutput("json", json.dumps(schema)), masks.vocabulary, 1)
    ids = [token for char in text for token in text_tokens(tokenizer, char)]
    matcher.catch_up(PROMPT[:1] + ids)
    return matcher.refused is None and bool(matcher.matcher and matcher.matcher.is_accepting())


def test_a_numbers_digits_are_bounded(masks: GrammarMasks, tokenizer: Tokenizer) -> None:
    """At temperature 1 SmolLM2 wrote a fraction of hundreds of digits until max_tokens cut
    the document: a number takes at most 10 fraction and 15 integral digits, as llama.cpp's
    schema grammars bound them, unless the caller's schema bounds it itself."""
    unit = {"type": "number", "minimum": -1, "maximum": 1}
    assert _takes(masks, tokenizer, unit, "0." + "1" * 10)
    assert not _takes(masks, tokenizer, unit, "0." + "1" * 11)
    assert _takes(masks, tokenizer, unit, "-1")
    assert not _takes(masks, tokenizer, unit, "1.5")  # the caller's bounds are kept
    for kind in ("number", "integer"):
        assert _takes(masks, tokenizer, {"type": kind}, "-" + "9" * 15)
        assert not _takes(masks, tokenizer, {"type": kind}, "1" + "0" * 15)
    big = {"type": "integer", "minimum": 10**17}  # a bound of its own beyond ours: kept
    assert _takes(masks, tokenizer, big, "1" + "0" * 17)
    exact = {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10**17}
    assert _takes(masks, tokenizer, exact, "1" + "0" * 16)
    assert _takes(masks, tokenizer, exact, "12.5")
    assert not _takes(masks, tokenizer, exact, "-1" + "0" * 15)  # ours on the other side
    assert not _takes(masks, tokenizer, exact, "0.25")
    # A const or enum bounds a number already: one of more digits is still allowed.
    const = {"type": "number", "const": 0.123456789012}
    assert _takes(masks, tokenizer, const, "0.123456789012")
    listed = {"type": "array", "items": {"type": "number", "enum": [0.123456789012, 2]}}
    assert _takes(masks, tokenizer, listed, "[0.123456789012, 2]")
