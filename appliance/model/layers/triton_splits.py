"""How many parts a decode's context is split into on the GPU (flash-decoding).

A decode launch runs one program per (sequence, KV head, query-row tile). At low batch
that is far fewer programs than the GPU has SMs (batch 1 of an 8B model: 8 programs on
an H100's 132), and each walks its whole context alone. Split over the context, each
program takes one part of the keys and writes a partial softmax (running max, sum,
unnormalized output); one more launch folds the parts. The rule below picks the number
of parts from plain numbers, so it is tested without torch or a GPU.
"""

from __future__ import annotations

MAX_SPLITS = 16  # the reduce loads every part of a row at once: a small power of two
# Keys a part walks at least: below four tiles of 64 the partial writes and the reduce
# launch cost more than the parallelism gains.
MIN_SPLIT_KEYS = 256
H100_SMS = 132  # an H100 SXM's SMs: the count assumed where no GPU is asked (tests)


def decode_splits(programs: int, max_keys: int, sm_count: int) -> int:
    """Parts to split each decode program's keys into: enough that programs x parts fill
    one wave of `sm_count` SMs, no more than MAX_SPLITS, and none shorter than
    MIN_SPLIT_KEYS keys of the longest context `max_keys`. 1 (no split) when the
    programs already fill the GPU or the contexts are short."""
    if programs < 1 or max_keys < 0 or sm_count < 1:
        raise ValueError(f"programs {programs}, max_keys {max_keys}, sm_count {sm_count}")
    if programs >= sm_count:
        return 1
    wave = -(-sm_count // programs)  # parts that fill the SMs once
    return max(1, min(MAX_SPLITS, wave, max_keys // MIN_SPLIT_KEYS))
