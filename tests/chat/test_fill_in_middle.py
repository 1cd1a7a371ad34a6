"""Fill-in-the-middle prompts (chat/fill_in_middle.py), on plain data: a family's markers
found in the vocabulary by their spelling, the prompt they make of the code around a
cursor and other files, cut to a budget the way an editor needs (the code nearest the
cursor kept), and code that spells a marker kept as text."""

from __future__ import annotations

from pathlib import Path

import pytest
from fim_tokenizers import fim_tokenizer

from appliance.chat.fill_in_middle import SNIPPET, ExtraFile, FillInMiddle
from appliance.model.model_source import prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


def tokenizer_of(tmp_path: Path, style: str) -> Tokenizer:
    return Tokenizer.load(fim_tokenizer(tmp_path / style, style))


def test_a_model_without_markers_has_none() -> None:
    smollm2 = prepare_tokenizer(None, load_settings().cache_dir)[1]
    assert FillInMiddle.of(smollm2) is None


def test_qwens_markers_make_prefix_suffix_middle(tmp_path: Path) -> None:
    tokenizer = tokenizer_of(tmp_path, "qwen")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo, fim.file_sep) == (11, 12, 13, 3, 5)
    assert {14, 5, 0} <= fim.ends  # <|fim_pad|>, <|file_sep|>, <|endoftext|>
    ids = fim.prompt(tokenizer, PREFIX, SUFFIX)
    before, after = tokenizer.encode_text(PREFIX), tokenizer.encode_text(SUFFIX)
    assert ids == [11, *before, 12, *after, 13]


def test_a_tokenizer_that_puts_a_bos_first_gets_it_first(tmp_path: Path) -> None:
    """CodeLlama, DeepSeek-Coder and Codestral were trained with their BOS first."""
    tokenizer = Tokenizer.load(fim_tokenizer(tmp_path / "bos", "qwen", bos=True))
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None and tokenizer.encode("") == [0]
    before, after = tokenizer.encode_text(PREFIX), tokenizer.encode_text(SUFFIX)
    assert fim.prompt(tokenizer, PREFIX, SUFFIX) == [0, 11, *before, 12, *after, 13]
    assert len(fim.prompt(tokenizer, PREFIX * 20, SUFFIX * 20, budget=40)) == 40


def test_other_files_come_first_in_the_repository_form(tmp_path: Path) -> None:
    tokenizer = tokenizer_of(tmp_path, "qwen")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None
    extra = (ExtraFile("util.py", "X = 1\n"), ExtraFile("main.py", "import util\n"))
    ids = fim.prompt(tokenizer, PREFIX, SUFFIX, extra)
    text = tokenizer.encode_text
    head = [3, *text("project\n"), 5, *text("util.py\n"), *text("X = 1\n")]
    head += [5, *text("main.py\n"), *text("import util\n"), 5, *text("filename\n")]
    assert ids == head + fim.prompt(tokenizer, PREFIX, SUFFIX)


def test_codestral_puts_the_suffix_first_and_joins_files_as_snippets(tmp_path: Path) -> None:
    tokenizer = tokenizer_of(tmp_path, "codestral")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None and fim.suffix_first and fim.file_sep is None
    ids = fim.prompt(tokenizer, PREFIX, SUFFIX, (ExtraFile("a.py", "A = 2\n"),))
    text = tokenizer.encode_text
    assert ids == [*text(SNIPPET), *text("A = 2\n"), 12, *text(SUFFIX), 11, *text(PREFIX)]


def test_starcoders_spelling_is_found_too(tmp_path: Path) -> None:
    tokenizer = tokenizer_of(tmp_path, "starcoder")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None and (fim.prefix, fim.middle) == (11, 13)
    assert fim.file_sep == 5  # SmolLM2's own <file_sep>, StarCoder's spelling


@pytest.mark.parametrize("budget", [40, 100, 1000])
def test_a_budget_keeps_the_code_nearest_the_cursor(tmp_path: Path, budget: int) -> None:
    tokenizer = tokenizer_of(tmp_path, "qwen")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None
    prefix = "".join(f"line_{i} = {i}\n" for i in range(60))
    suffix = "".join(f"after_{i} = {i}\n" for i in range(60))
    extra = (ExtraFile("other.py", "OTHER = 1\n" * 30),)
    ids = fim.prompt(tokenizer, prefix, suffix, extra, budget=budget)
    before, after = tokenizer.encode_text(prefix), tokenizer.encode_text(suffix)
    assert len(ids) <= budget
    start, cut, end = ids.index(11), ids.index(12), ids.index(13)
    kept_before, kept_after = ids[start + 1 : cut], ids[cut + 1 : end]
    assert kept_before == before[len(before) - len(kept_before) :]  # its end
    assert kept_after == after[: len(kept_after)]  # its start
    if budget < len(before) + len(after):
        assert start == 0 and len(ids) == budget  # the other file went first, then code
        if len(kept_before) < len(before) and len(kept_after) < len(after):
            assert len(kept_before) == pytest.approx(3 * len(kept_after), abs=2)  # 3:1
    else:
        assert (kept_before, kept_after) == (before, after)


def test_code_that_spells_a_marker_stays_text(tmp_path: Path) -> None:
    tokenizer = tokenizer_of(tmp_path, "qwen")
    fim = FillInMiddle.of(tokenizer)
    assert fim is not None
    ids = fim.prompt(tokenizer, 'MARK = "<|fim_middle|>"\n', "")
    assert ids.count(13) == 1 and ids[-1] == 13  # only the real one, at the end
    assert tokenizer.encode('"<|fim_middle|>"', add_special_tokens=False).count(13) == 1
