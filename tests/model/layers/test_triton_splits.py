"""decode_splits, the rule that splits a decode's context over more programs
(flash-decoding), on plain numbers: no torch, no GPU."""

from __future__ import annotations

import pytest

from appliance.model.layers.triton_splits import (
    H100_SMS,
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    decode_splits,
)


def test_batch_one_of_an_8b_model_at_8k_fills_the_h100() -> None:
    # 1 sequence x 8 KV heads = 8 programs on 132 SMs: 17 parts would fill one wave,
    # the cap keeps 16 (128 programs), each walking 512 of the 8192 keys.
    assert decode_splits(programs=8, max_keys=8192, sm_count=H100_SMS) == MAX_SPLITS == 16


def test_parts_fill_one_wave_and_no_more() -> None:
    # 40 programs: 4 parts make 160 >= 132 (3 would leave SMs idle: 120).
    assert decode_splits(programs=40, max_keys=8192, sm_count=132) == 4
    # A GPU with fewer SMs (an RTX 4090's 128, an L4's 58) asks fewer parts.
    assert decode_splits(programs=40, max_keys=8192, sm_count=58) == 2


def test_programs_that_fill_the_gpu_are_not_split() -> None:
    # Batch 32 x 8 KV heads = 256 programs: already two waves on an H100.
    assert decode_splits(programs=256, max_keys=32768, sm_count=132) == 1
    assert decode_splits(programs=132, max_keys=32768, sm_count=132) == 1


def test_short_contexts_are_not_cut_below_the_minimum_part() -> None:
    assert decode_splits(programs=8, max_keys=MIN_SPLIT_KEYS - 1, sm_count=132) == 1
    assert decode_splits(programs=8, max_keys=3 * MIN_SPLIT_KEYS, sm_count=132) == 3
    assert decode_splits(programs=1, max_keys=0, sm_count=132) == 1


@pytest.mark.parametrize("programs", [1, 2, 3, 8, 17, 64, 131, 132, 500])
@pytest.mark.parametrize("max_keys", [1, 255, 256, 1000, 4096, 131072])
def test_splits_stay_in_range_and_never_leave_a_part_short(programs: int, max_keys: int) -> None:
    splits = decode_splits(programs, max_keys, H100_SMS)
    assert 1 <= splits <= MAX_SPLITS
    if splits > 1:
        assert max_keys // splits >= MIN_SPLIT_KEYS
        assert programs * (splits - 1) < H100_SMS  # one part fewer would not fill the wave


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="programs 0"):
        decode_splits(0, 100, 132)
    with pytest.raises(ValueError, match="sm_count 0"):
        decode_splits(1, 100, 0)
