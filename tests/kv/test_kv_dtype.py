"""The KV cache in another dtype than the activations (kv_cache_dtype): the setting, the
pool's tensor and sizing, K/V rounded as written and widened as read by paged attention
(the compiled CPU kernel and the torch paths), and handoffs that move the stored dtype
as is and refuse pools of two dtypes. No model: small random tensors."""

from __future__ import annotations

import types

import pytest
import torch

from appliance.engine.kv_pool_sizing import pool_blocks
from appliance.kv.byte_ranges import copy_ranges
from appliance.kv.cache import KVCache, KVLayout, resolve_kv_dtype
from appliance.kv.handoff import KVShard, copy_blocks
from appliance.kv.remote import check_source_dtype, pool_shape
from appliance.model import cpu_kernels
from appliance.model.layers.paged_attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillSegment,
    paged_attention,
    sdpa_decode,
    write_kv,
)
from appliance.settings.config import SettingsError, load_settings

CPU = torch.device("cpu")
# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64 (9 query heads).
SMOL = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}


def layout(dtype: torch.dtype) -> KVLayout:
    return KVLayout(dtype=dtype, **SMOL)


# ---------------------------------------------------------------- the setting


def test_auto_keeps_the_activations_dtype_and_names_pick_theirs() -> None:
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.bfloat16, CPU) == torch.float32


def test_a_gpu_keeps_the_activations_dtype_and_says_so_otherwise() -> None:
    cuda = torch.device("cuda")
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype=float32: on cuda"):
        resolve_kv_dtype("float32", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="not one of auto, float32, bfloat16"):
        resolve_kv_dtype("q8_0", torch.float32, CPU)


def test_the_setting_is_read_by_its_vllm_name_and_checked() -> None:
    assert load_settings().kv_cache_dtype == "auto"
    assert load_settings(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(SettingsError, match="kv_cache_dtype"):
        load_settings(kv_cache_dtype="float16")


# ---------------------------------------------------------------- the pool and its size


def test_a_bfloat16_pool_holds_bfloat16_in_half_the_bytes() -> None:
    wide, narrow = layout(torch.float32), layout(torch.bfloat16)
    pool = KVCache(narrow, 8, CPU)
    assert pool.tensor.dtype == torch.bfloat16 and pool.layer(3)[0].dtype == torch.bfloat16
    assert pool.tensor.untyped_storage().nbytes() == 8 * narrow.bytes_per_block()
    assert 2 * narrow.bytes_per_block() == wide.bytes_per_block()


def test_the_same_memory_buys_twice_the_bfloat16_blocks() -> None:
    """pool_blocks, as load_shard calls it on the CPU: kv.memory_mb buys blocks of the
    pool's own dtype."""
    settings = load_settings(kv={"memory_mb": 512})
    model = types.SimpleNamespace(device=CPU)
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        own = layout(dtype)
        counts[dtype] = pool_blocks(settings, model, own, own, 8192)  # type: ignore[arg-type]
    assert counts[torch.float32] == 512 * 2**20 // layout(torch.float32).bytes_per_block()
    # 2x, less at most one block lost to rounding down
    assert 2 * counts[torch.float32] <= counts[torch.bfloat16] <= 2 * counts[torch.float32] + 1


def resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_cpu_pool_is_zeros_that_take_memory_only_where_written(shared: bool) -> None:
    """A worker's pool (512 MiB by default) is not written when made: torch.zeros, and
    share_memory_'s copy after it, cost ~0.7 s a worker start and made every page
    resident. The kernel zero-fills each page at its first touch."""
    blocks = 256 * 2**20 // layout(torch.bfloat16).bytes_per_block()  # 256 MiB
    before = resident_mib()
    pool = KVCache(layout(torch.bfloat16), blocks, CPU, shared=shared)
    assert pool.tensor.is_shared() == shared and pool.tensor.is_contiguous()
    assert resident_mib() - before < 16
    k, v = pool.layer(29)
    assert not k[-1].any() and not v[-1].any() and not pool.tensor[0, 0, 0].any()
    k[-1] = 1.5
    assert pool.tensor[29, 0, -1].eq(1.5).all() and not pool.tensor[29, 1, -1].any()
    assert resident_mib() - before < 16


# ---------------------------------------------------------------- written and read


def pool_and_batch(
    dtype: torch.dtype, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
    """A one-layer pool in `dtype` holding random K/V of float32 values for sequences of
    context `lens`, each in its own blocks; returns k_cache, v_cache, the float32 values
    written (rows of slots) and the decode group of the sequences."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv_heads, dim = SMOL["block_size"], SMOL["num_kv_heads"], SMOL["head_dim"]
    width = max(-(-n // bs) for n in lens)
    blocks = len(lens) * width
    cache = KVCache(KVLayout(1, bs, kv_heads, dim, dtype), blocks, CPU)
    k_cache, v_cache = cache.layer(0)
    tables = torch.arange(blocks).view(len(lens), width)
    slots = torch.cat([tables[i].repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])  # fmt: skip
    values = torch.randn(2, len(slots), kv_heads, dim, generator=gen)
    write_kv(k_cache, v_cache, values[0], values[1], slots)
    ctx = width * bs
    visible = torch.arange(ctx)[None, :] < torch.tensor(lens)[:, None]
    group = DecodeGroup(None, tables, visible[:, None, None, :], torch.tensor(lens))
    return k_cache, v_cache, values, group


def test_keys_and_values_are_rounded_to_the_pool_as_written() -> None:
    k_cache, v_cache, values, _ = pool_and_batch(torch.bfloat16, [40])
    stored = k_cache.flatten(0, 1)[:40]
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored, values[0].to(torch.bfloat16))
    assert torch.equal(v_cache.flatten(0, 1)[:40], values[1].to(torch.bfloat16))


def test_float32_queries_decode_over_a_bfloat16_pool_as_over_its_values_widened() -> None:
    """The kernel (queries rounded to bfloat16, float32 sums) and SDPA over the widened
    pool answer within bfloat16's rounding of the queries and the output; both differ
    from float32 K/V by the pool's own rounding, a few times more."""
    lens = [5, 77, 300, 33]
    heads = 9
    k_cache, v_cache, _, group = pool_and_batch(torch.bfloat16, lens, seed=1)
    q = torch.randn(len(lens), heads, SMOL["head_dim"], generator=torch.Generator().manual_seed(2))
    batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), [], 0, [group])
    scale = SMOL["head_dim"] ** -0.5
    out = paged_attention(q, q, q, k_cache, v_cache, batch, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    widened = sdpa_decode(q, k_cache, v_cache, group, scale)
    assert widened.dtype == torch.float32
    assert (out - widened).abs().max() < 2e-2
    wide_k, wide_v, _, _ = pool_and_batch(torch.float32, lens, seed=1)
    exact = sdpa_decode(q, wide_k, wide_v, group, scale)
    assert 1e-4 < (widened - exact).abs().max() < 5e-2  # the pool's rounding shows, bounded


@pytest.mark.skipif(not cpu_kernels.available(), reason="the compiled CPU kernels are not built")
def test_the_compiled_kernel_reads_the_bfloat16_pool_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k_cache, v_cache, _, group = pool_and_batch(torch.bfloat16, [64, 9])
    q = torch.randn(2, 9, SMOL["head_dim"])
    seen: list[torch.dtype] = []
    real = cpu_kernels.paged_decode

    def spy(rows: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(rows.dtype)
        return real(rows, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "paged_decode", spy)
    batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), [], 0, [group])
    out = paged_attention(q, q, q, k_cache, v_cache, batch, SMOL["head_dim"] ** -0.5)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32


def test_a_prefill_after_cached_blocks_reads_them_widened() -> None:
    """A second prompt chunk attends to the first chunk's K/V from a bfloat16 pool: the
    answer is the float32 attention over those K/V rounded to bfloat16 (and its own)."""
    bs, kv_heads, dim, heads = SMOL["block_size"], SMOL["num_kv_heads"], SMOL["head_dim"], 9
    cache = KVCache(KVLayout(1, bs, kv_heads, dim, torch.bfloat16), 4, CPU)
    k_cache, v_cache = cache.layer(0)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 50, kv_heads, dim, generator=gen)
    q = torch.randn(50, heads, dim, generator=gen)
    slots = torch.arange(50)
    write_kv(k_cache, v_cache, k, v, slots)  # the first chunk (30) and this one (20)
    seg = PrefillSegment(start=0, length=20, context_len=50, block_table=torch.arange(4))
    batch = AttentionBatch(slots[30:], [seg], 20, [])
    scale = dim**-0.5
    out = paged_attention(q[30:], k[30:], v[30:], k_cache, v_cache, batch, scale)
    assert out.dtype == torch.float32
    rounded_k, rounded_v = (t.to(torch.bfloat16).float() for t in (k, v))
    mask = torch.arange(50)[None, :] <= torch.arange(30, 50)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[30:].transpose(0, 1)[None],
        rounded_k.transpose(0, 1)[None],
        rounded_v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- handoffs


def test_a_handoff_moves_bfloat16_blocks_bit_for_bit() -> None:
    src = torch.randn(2, 2, 6, 4, 1, 8).to(torch.bfloat16)
    dst = torch.zeros(2, 2, 5, 4, 1, 8, dtype=torch.bfloat16)
    moved = copy_blocks(src, [4, 1], dst, [0, 3])
    assert torch.equal(dst[:, :, 0], src[:, :, 4]) and torch.equal(dst[:, :, 3], src[:, :, 1])
    assert moved == 2 * src[:, :, 0].numel() * 2  # two bytes a value


def test_pools_of_two_dtypes_are_refused_not_converted() -> None:
    """A conversion would round (or widen) the prefill's K/V into other numbers than a
    colocated worker reads; the workers' settings differ, which is what the error says."""
    bf16 = torch.zeros(2, 2, 4, 4, 1, 8, dtype=torch.bfloat16)
    f32 = torch.zeros(2, 2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match=r"differ in dtype: bfloat16 vs float32.*kv_cache_dtype"):
        copy_blocks(bf16, [0], f32, [0])
    with pytest.raises(ValueError, match="bfloat16 and this pool keeps float32"):
        check_source_dtype([KVShard(0, bf16)], torch.float32)
    check_source_dtype([KVShard(0, bf16)], torch.bfloat16)  # the same dtype passes


def test_the_cross_box_transfer_names_and_checks_the_stored_dtype() -> None:
    bf16 = torch.zeros(2, 2, 4, 4, 1, 8, dtype=torch.bfloat16)
    fp16 = torch.zeros(2, 2, 4, 4, 1, 8, dtype=torch.float16)
    shape = pool_shape(bf16)
    assert (shape.dtype, shape.elem_size) == ("bfloat16", 2)
    assert copy_ranges(shape, [1], pool_shape(bf16.clone()), [2])  # same dtype: bytes as is
    # Both two bytes a value: only the name tells them apart.
    with pytest.raises(ValueError, match="differ in dtype: bfloat16 vs float16"):
        copy_ranges(shape, [1], pool_shape(fp16), [2])
