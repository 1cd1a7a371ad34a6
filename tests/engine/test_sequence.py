"""SamplingParams validation and Sequence bookkeeping."""

from __future__ import annotations

import dataclasses
import math

import pytest

from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus


def test_defaults_are_greedy_and_valid() -> None:
    params = SamplingParams()
    assert params.greedy
    assert params.max_tokens == 256
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.seed is None
    assert params.stop == ()
    assert params.stop_token_ids == ()
    assert not params.ignore_eos


@pytest.mark.parametrize("temperature", [1e-5, 0.7, 1.0, 5.0])
def test_positive_temperature_is_not_greedy(temperature: float) -> None:
    assert not SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("temperature", [1e-6, 1e-300])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    # logits / 1e-300 overflow to inf and the sampler would fail: it is greedy anyway.
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("max_tokens", [0, -1, -100])
def test_max_tokens_below_one_raises(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens") as info:
        SamplingParams(max_tokens=max_tokens)
    assert str(max_tokens) in str(info.value)


def test_max_tokens_of_one_is_fine() -> None:
    assert SamplingParams(max_tokens=1).max_tokens == 1


@pytest.mark.parametrize("temperature", [-0.1, -1.0, math.nan, math.inf, -math.inf])
def test_bad_temperature_raises(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.0001, 2.0, math.nan])
def test_top_p_outside_zero_one_raises(top_p: float) -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("top_p", [1e-9, 0.5, 1.0])
def test_top_p_inside_zero_one_is_fine(top_p: float) -> None:
    assert SamplingParams(top_p=top_p).top_p == top_p


@pytest.mark.parametrize("top_k", [-1, -50])
def test_negative_top_k_raises(top_k: int) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)


@pytest.mark.parametrize("top_k", [0, 1, 40])
def test_non_negative_top_k_is_fine(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).top_k == top_k


@pytest.mark.parametrize("stop", ["", ("ok", ""), ["", "x"]])
def test_empty_stop_string_raises(stop: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)  # type: ignore[arg-type]


def test_single_stop_string_becomes_a_tuple() -> None:
    params = SamplingParams(stop="</s>")
    assert params.stop == ("</s>",)


def test_stop_list_becomes_a_tuple() -> None:
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[2, 3])  # type: ignore[arg-type]
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (2, 3)
    hash(params)  # frozen and made of tuples: usable as a key


def test_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]


def test_valid_combination_keeps_every_field() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.8, top_k=5, top_p=0.9, seed=123, ignore_eos=True
    )
    assert (params.max_tokens, params.temperature, params.top_k) == (7, 0.8, 5)
    assert (params.top_p, params.seed, params.ignore_eos) == (0.9, 123, True)


def test_sequence_needs_a_prompt() -> None:
    with pytest.raises(ValueError, match="token"):
        Sequence(0, [], SamplingParams())


def test_new_sequence_bookkeeping() -> None:
    seq = Sequence(3, [10, 11, 12], SamplingParams())
    assert seq.seq_id == 3
    assert len(seq) == 3
    assert seq.num_prompt_tokens == 3
    assert seq.num_computed_tokens == 0
    assert seq.num_uncomputed == 3
    assert seq.output_ids == []
    assert seq.block_table == []
    assert seq.status is SequenceStatus.WAITING
    assert not seq.finished
    assert seq.finish_reason is None


def test_output_ids_follow_the_prompt() -> None:
    seq = Sequence(0, [1, 2], SamplingParams())
    seq.token_ids += [7, 8]
    seq.num_computed_tokens = 3
    assert seq.output_ids == [7, 8]
    assert seq.num_prompt_tokens == 2
    assert seq.num_uncomputed == 1
    assert len(seq) == 4


def test_block_tables_are_not_shared() -> None:
    a = Sequence(0, [1], SamplingParams())
    b = Sequence(1, [1], SamplingParams())
    a.block_table.append(5)
    assert b.block_table == []


def test_sequences_compare_by_identity() -> None:
    params = SamplingParams()
    a = Sequence(0, [1, 2], params)
    b = Sequence(0, [1, 2], params)
    assert a != b
    assert a == a
    assert len({a, b}) == 2


def test_finished_follows_status() -> None:
    seq = Sequence(0, [1], SamplingParams())
    seq.status = SequenceStatus.RUNNING
    assert not seq.finished
    seq.status = SequenceStatus.FINISHED
    assert seq.finished
