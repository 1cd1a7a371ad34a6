"""Grouping decodes by context width, on plain lists."""

from __future__ import annotations

import random

from appliance.engine.decode_groups import decode_groups


def cost(widths: list[int], groups: list[list[int]], overhead: int) -> int:
    return sum(overhead + len(g) * max(widths[i] for i in g) for g in groups)


def test_similar_widths_stay_one_group() -> None:
    assert decode_groups([3, 4, 4, 3, 2]) == [[4, 0, 3, 1, 2]]


def test_a_long_sequence_gets_its_own_group() -> None:
    widths = [7] * 9 + [125]
    groups = decode_groups(widths)
    assert groups == [list(range(9)), [9]]
    assert cost(widths, groups, 32) < cost(widths, [list(range(10))], 32)


def test_every_sequence_lands_in_exactly_one_group_within_the_cap() -> None:
    rng = random.Random(0)
    for _ in range(200):
        widths = [rng.choice([1, 2, 5, 8, 30, 125]) for _ in range(rng.randint(1, 64))]
        groups = decode_groups(widths)
        assert sorted(i for g in groups for i in g) == list(range(len(widths)))
        for g in groups:
            assert len(g) == 1 or len(g) * max(widths[i] for i in g) <= 128


def test_the_split_is_optimal_for_small_cases() -> None:
    """Against brute force over every way to cut the width-sorted order."""
    rng = random.Random(1)
    for _ in range(100):
        widths = [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
        order = sorted(range(len(widths)), key=widths.__getitem__)
        best = min(
            cost(widths, split(order, mask), 32)
            for mask in range(2 ** (len(order) - 1))
            if all(
                len(g) == 1 or len(g) * max(widths[i] for i in g) <= 128 for g in split(order, mask)
            )
        )
        assert cost(widths, decode_groups(widths), 32) == best


def split(order: list[int], mask: int) -> list[list[int]]:
    groups, current = [], [order[0]]
    for k, index in enumerate(order[1:]):
        if mask >> k & 1:
            groups.append(current)
            current = []
        current.append(index)
    return [*groups, current]


def test_no_decodes_no_groups() -> None:
    assert decode_groups([]) == []
