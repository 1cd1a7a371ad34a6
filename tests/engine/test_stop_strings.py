"""StopStringMatcher: hold back possible stop-string prefixes, cut exactly at a stop."""

from __future__ import annotations

import pytest

from appliance.engine.stop_strings import StopStringMatcher


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], str, bool]:
    """Feed every delta, then flush; return per-feed pieces, all shown text, stopped."""
    matcher = StopStringMatcher(stops)
    pieces = [matcher.feed(d) for d in deltas]
    shown = "".join(pieces) + matcher.flush()
    return pieces, shown, matcher.stopped


def test_no_stops_is_passthrough() -> None:
    deltas = ["Hello", ", ", "world", "", "!"]
    pieces, shown, stopped = run((), deltas)
    assert pieces == deltas
    assert shown == "Hello, world!"
    assert not stopped


def test_text_that_cannot_start_a_stop_is_emitted_at_once() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("hello ") == "hello "
    assert matcher.feed("there") == "there"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_inside_one_delta_emits_exact_text_before_it() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("abcSTOPdef") == "abc"
    assert matcher.stopped
    assert matcher.text == "abc"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


def test_stop_at_very_start() -> None:
    pieces, shown, stopped = run(("###",), ["###", "after"])
    assert pieces == ["", ""]
    assert shown == ""
    assert stopped


def test_partial_match_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("abcST") == "abc"  # "ST" might begin "STOP"
    assert matcher.feed("O") == ""  # "STO" still might
    assert matcher.feed("x") == "STOx"  # no longer: everything goes out
    assert not matcher.stopped


def test_stop_split_across_many_deltas() -> None:
    deltas = ["He", "llo", " <", "|", "e", "n", "d", "|", "> ignored"]
    pieces, shown, stopped = run(("<|end|>",), deltas)
    assert shown == "Hello "
    assert stopped
    # Nothing of the stop string ever leaked out while it was being built.
    assert "<" not in "".join(pieces)


def test_stop_split_one_character_at_a_time() -> None:
    text = "the answer is 42\n\nQuestion: next"
    pieces, shown, stopped = run(("\n\nQuestion:",), list(text))
    assert shown == "the answer is 42"
    assert "".join(pieces) == "the answer is 42"
    assert stopped


def test_held_back_text_is_flushed_when_no_stop_comes() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("end with ST") == "end with "
    assert matcher.flush() == "ST"
    assert not matcher.stopped
    assert matcher.flush() == ""  # nothing is emitted twice


def test_multiple_stops_earliest_position_wins() -> None:
    matcher = StopStringMatcher(("world", "lo"))
    assert matcher.feed("hello world") == "hel"
    assert matcher.stopped
    assert matcher.text == "hel"


def test_multiple_stops_order_in_tuple_does_not_matter() -> None:
    for stops in [("B", "A"), ("A", "B")]:
        _, shown, stopped = run(stops, ["xxAyyB"])
        assert shown == "xx"
        assert stopped


def test_multiple_stops_across_deltas() -> None:
    _, shown, stopped = run(("</s>", "\nUser:"), ["Sure.", "\n", "Us", "er", ": hi", "</s>"])
    assert shown == "Sure."
    assert stopped


def test_shorter_stop_completing_first_wins_over_longer_prefix() -> None:
    # "bc" completes while "abcd" is still only a prefix: cut right before "bc".
    _, shown, stopped = run(("abcd", "bc"), ["a", "b", "c", "d"])
    assert shown == "a"
    assert stopped


def test_hold_back_uses_longest_matching_prefix() -> None:
    matcher = StopStringMatcher(("aab",))
    assert matcher.feed("a") == ""
    assert matcher.feed("a") == ""
    assert matcher.feed("a") == "a"  # tail "aa" can still start "aab"
    assert matcher.feed("b") == ""
    assert matcher.stopped
    assert matcher.text == "a"
    assert matcher.flush() == ""


def test_near_miss_is_emitted_in_full() -> None:
    _, shown, stopped = run(("STOP",), ["ST", "OOP", "S", "TO", "P!"])
    assert shown == "STOOP"  # "STOOPSTOP!" holds "STOP" at index 5
    assert stopped


def test_unicode_stop_string() -> None:
    _, shown, stopped = run(("。終",), ["こんにちは", "。", "終わり"])
    assert shown == "こんにちは"
    assert stopped


@pytest.mark.parametrize("split", range(1, 12))
def test_every_split_point_gives_the_same_result(split: int) -> None:
    text = "abc<stop>def"
    _, shown, stopped = run(("<stop>",), [text[:split], text[split:]])
    assert shown == "abc"
    assert stopped


def test_concatenation_of_pieces_equals_text_without_stop() -> None:
    deltas = ["a", "b<", "x", ">c<", "st", "o", "p", ">d"]
    pieces, shown, _ = run(("<stop>",), deltas)
    assert shown == "ab<x>c"
    assert "".join(pieces) == shown


def test_included_the_stop_string_ends_the_text() -> None:
    """vLLM's include_stop_str_in_output: cut after the stop, not before; held back as
    ever until it is whole."""
    matcher = StopStringMatcher(("</tool>", "END"), include=True)
    assert matcher.feed("call <") == "call "
    assert matcher.feed("/too") == ""
    assert matcher.feed("l> and more") == "</tool>"
    assert matcher.stopped and matcher.text == "call </tool>"
    assert matcher.flush() == ""


def test_of_stops_starting_at_one_place_the_longest_is_included() -> None:
    matcher = StopStringMatcher(("ab", "abc"), include=True)
    assert matcher.feed("xabcd") == "xabc"
    assert StopStringMatcher(("ab", "abc")).feed("xabcd") == "x"
