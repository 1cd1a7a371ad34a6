"""The compiled CPU kernels against the torch ops they replace, and their input checks.

`./install.sh` builds them with the machine's C compiler; a checkout where they are not
built fails here (the model would still run, on the torch ops, but slower)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.cpu_kernels import loading
from appliance.model.layers.paged_attention import DecodeGroup, sdpa_decode, write_kv
from appliance.model.layers.rotary import apply_rope

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

BLOCK = 16


def test_the_kernels_are_built() -> None:
    assert cpu_kernels.available(), (
        "no CPU kernels built from these sources: install a C compiler, re-run ./install.sh"
    )


def _decode_problem(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """Caches with shuffled blocks, and queries viewed out of a wider row as the model's
    q is (its q/k rows share one tensor)."""
    gen = torch.Generator().manual_seed(seed)
    width = max((n + BLOCK - 1) // BLOCK for n in lens)
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    return qk[:, :heads], k_cache, v_cache, tables, torch.tensor(lens)


def _sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    keys = torch.arange(tables.shape[1] * BLOCK)
    visible = (keys[None, :] < lens[:, None])[:, None, None, :]
    return sdpa_decode(
        q.contiguous(), k_cache, v_cache, DecodeGroup(None, tables, visible, lens), scale
    )


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "head_dim"),
    [
        ([1], 9, 3, 64),  # a first decode token: one key
        ([15, 16, 17, 33, 100], 9, 3, 64),  # ragged, around block edges
        ([40, 7], 8, 8, 64),  # no grouping
        ([64, 130, 5], 32, 8, 128),  # Llama-style groups of 4 at head size 128
        ([300] * 40, 9, 3, 64),  # enough work to run on several threads
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_sdpa(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, tables, context = _decode_problem(
        lens, heads, kv_heads, head_dim, dtype, 0
    )
    assert cpu_kernels.decode_takes(q, k_cache, v_cache)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, context, scale)
    want = _sdpa(q, k_cache, v_cache, tables, context, scale)
    assert got.shape == want.shape == (len(lens), heads, head_dim)
    assert got.dtype == dtype
    # float32: the same sums in another order. bfloat16: one rounding of each output.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def _with_chunk(
    problem: tuple[torch.Tensor, ...], row: int, extra: int
) -> tuple[torch.Tensor, ...]:
    """The problem with `extra` more rows after `row`: the same sequence's next queries
    (a verify chunk's draft tokens), its table and one more context token each; the
    problem's row `row` is `extra` tokens longer than the chunk's first (room in its
    table)."""
    q, k_cache, v_cache, tables, lens = problem
    lens = lens.clone()
    lens[row] -= extra
    gen = torch.Generator().manual_seed(row + extra)
    drafts = torch.randn(extra, *q.shape[1:], generator=gen).to(q.dtype)
    q = torch.cat([q[: row + 1], drafts, q[row + 1 :]])
    tables = torch.cat([tables[: row + 1], tables[row].expand(extra, -1), tables[row + 1 :]])
    more = lens[row] + torch.arange(1, extra + 1)
    lens = torch.cat([lens[: row + 1], more, lens[row + 1 :]])
    return q, k_cache, v_cache, tables, lens


def _each_alone(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode of each row in a call of its own, the rows' outputs stacked."""
    rows = range(len(lens))
    return torch.cat([
        cpu_kernels.paged_decode(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                 lens[i : i + 1], scale)
        for i in rows
    ])  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "row", "extra"),
    [
        ([20, 40, 33], 1, 4),  # a 5-row chunk between two other sequences, in one block pair
        ([300], 0, 8),  # batch 1, k = 8: enough work for the threads, a chunk cut in parts
        ([15, 47, 300, 31], 2, 17),  # longer than a span (16 rows): two spans
        ([40000], 0, 8),  # a long context: a thread's scores hold 8 rows of it, two spans
    ],
)
def test_a_verify_chunks_rows_attend_as_each_row_alone(
    lens: list[int], row: int, extra: int, dtype: torch.dtype, threads: int
) -> None:
    """Rows of one sequence whose contexts grow by one token each read the context once
    for all (paged_decode.c: spans): each row's output holds the bits it has alone, and
    SDPA's numbers, whatever the rows around it and the threads."""
    sized = [n + extra * (i == row) for i, n in enumerate(lens)]
    problem = _with_chunk(_decode_problem(sized, 9, 3, 64, dtype, 6), row, extra)
    q, k_cache, v_cache, tables, context = problem
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu_kernels.paged_decode(*problem, 0.125)
        alone = _each_alone(q, k_cache, v_cache, tables, context, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    want = _sdpa(q, k_cache, v_cache, tables, context, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(together.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_rows_whose_lengths_chain_but_tables_differ_attend_apart() -> None:
    """Three sequences of 20, 21 and 22 tokens sharing their first block (a cached
    prefix) but not their second: not a span (each reads its own second block)."""
    q, k_cache, v_cache, tables, lens = _decode_problem([20, 21, 22], 9, 3, 64, torch.float32, 7)
    tables[1:, 0] = tables[0, 0]
    together = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    alone = _each_alone(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, _sdpa(q, k_cache, v_cache, tables, lens, 0.125))


def test_paged_decode_reads_only_each_context() -> None:
    """Keys past a sequence's length, and blocks it does not own, change nothing."""
    q, k_cache, v_cache, tables, lens = _decode_problem([20, 3], 9, 3, 64, torch.float32, 1)
    before = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    k_cache[tables[0, 1], 4:] = 1e4  # slots 20.. of sequence 0's second block
    v_cache[tables[1, 0], 3:] = 1e4
    k_cache[tables[1, 1]] = float("nan")  # sequence 1 never reaches its second block
    after = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, n: (t, torch.tensor([17, 3])), "outside its block table"),  # 17 > 1 block
        (lambda t, n: (t, torch.tensor([0, 3])), "outside its block table"),
        (lambda t, n: (torch.full_like(t, 99), n), "outside the cache"),
        (lambda t, n: (torch.full_like(t, -1), n), "outside the cache"),
    ],
)
def test_paged_decode_refuses_reads_outside_the_cache(
    change: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    message: str,
) -> None:
    q, k_cache, v_cache, tables, lens = _decode_problem([16, 3], 9, 3, 64, torch.float32, 2)
    tables, lens = change(tables, lens)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)


def test_paged_decode_refuses_mismatched_inputs() -> None:
    q, k_cache, v_cache, tables, lens = _decode_problem([5], 9, 3, 64, torch.float32, 3)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.paged_decode(q[:, :8], k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, tables.int(), lens, 0.125)
    with pytest.raises(ValueError, match="match each other"):
        cpu_kernels.paged_decode(q, k_cache, v_cache[:2], tables, lens, 0.125)
    with pytest.raises(ValueError, match="2 block tables"):
        cpu_kernels.paged_decode(q.expand(2, -1, -1), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="2-D int64"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, tables[None], lens, 0.125)
    with pytest.raises(ValueError, match="match each other"):  # read at the wrong width
        cpu_kernels.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.125)
    with pytest.raises(ValueError, match="do not fit"):  # 72 query heads on one KV head
        cpu_kernels.paged_decode(
            q.repeat(1, 8, 1), k_cache[:, :, :1], v_cache[:, :, :1], tables, lens, 0.125
        )


def test_decode_takes_only_what_it_has_code_for() -> None:
    q, k_cache, v_cache, _, _ = _decode_problem([5], 9, 3, 64, torch.float32, 4)
    assert cpu_kernels.decode_takes(q, k_cache, v_cache)
    assert not cpu_kernels.decode_takes(q.half(), k_cache.half(), v_cache.half())
    assert not cpu_kernels.decode_takes(q[..., :32], k_cache[..., :32], v_cache[..., :32])
    assert not cpu_kernels.decode_takes(q, k_cache.transpose(0, 1), v_cache)
    cpu = torch.device("cpu")
    assert cpu_kernels.decodes_ragged(cpu, torch.bfloat16, 128, group=8)
    assert not cpu_kernels.decodes_ragged(cpu, torch.bfloat16, 128, group=65)
    assert not cpu_kernels.decodes_ragged(torch.device("cuda"), torch.bfloat16, 64)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    start = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    residual = start.clone()
    out, returned = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    want_sum = start + x
    assert returned is residual  # updated in place
    assert torch.equal(residual, want_sum)  # the add rounds exactly as torch's
    want = F.rms_norm(want_sum, (576,), weight, 1e-5)
    # The sum of squares in another order: at most one rounding step apart.
    torch.testing.assert_close(out, want, atol=0, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    if dtype == torch.bfloat16:
        assert (out != want).float().mean() < 0.01


def test_add_rms_norm_without_an_addend_only_normalizes() -> None:
    residual = torch.randn(4, 64)
    copy = residual.clone()
    out, returned = cpu_kernels.add_rms_norm(None, residual, torch.ones(64), 1e-6)
    assert torch.equal(returned, copy)
    torch.testing.assert_close(out, F.rms_norm(copy, (64,), torch.ones(64), 1e-6))


def test_add_rms_norm_refuses_mismatched_inputs() -> None:
    residual = torch.randn(4, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.add_rms_norm(None, residual, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="cannot add"):
        cpu_kernels.add_rms_norm(torch.randn(3, 64), residual, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.add_rms_norm(None, torch.randn(64, 4).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.add_rms_norm(None, residual, torch.ones(64).bfloat16(), 1e-6)
    assert cpu_kernels.norm_takes(None, residual, torch.ones(64))
    assert not cpu_kernels.norm_takes(None, torch.randn(4, 60), torch.ones(60))  # not 16k
    assert not cpu_kernels.norm_takes(None, residual.half(), torch.ones(64).half())
    assert not cpu_kernels.norm_takes(torch.randn(4, 64).bfloat16(), residual, torch.ones(64))


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 96, generator=gen) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])  # past the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    exact = F.silu(gate.double()) * up.double()
    torch_way = F.silu(gate) * up  # in the dtype: silu rounded, then the product
    out = cpu_kernels.silu_mul(gate_up)
    assert out.data_ptr() == gate_up.data_ptr() and out.shape == (rows, 96)  # in place
    if dtype == torch.float32:  # a few ulps of float32
        torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-30)
    else:  # rounded as torch rounds: where its exp's last bit tips a rounding, one step
        torch.testing.assert_close(out, torch_way, rtol=8e-3, atol=1e-30)
        assert (out != torch_way).float().mean() < 0.02


def test_silu_mul_refuses_what_it_has_no_code_for() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.silu_mul(torch.randn(2, 40))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.silu_mul(torch.randn(64, 2).t())
    assert not cpu_kernels.silu_takes(torch.randn(2, 64).half())
    assert cpu_kernels.silu_takes(torch.randn(2, 64))


def _greedy(engine: LLMEngine) -> list[list[int]]:
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Name three colours.", "Count to five.")
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)]


def test_the_model_decodes_alike_on_the_kernels_and_on_torch_ops(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 greedy outputs are the same either way, and every kernel did run."""
    calls: Counter[str] = Counter()
    built = loading.compiled()

    def counted(name: str) -> Callable[..., None]:
        def call(*args: object) -> None:
            calls[name] += 1
            getattr(built, name)(*args)

        return call

    names = ("paged_decode", "add_rms_norm", "rope_store", "silu_mul")
    spy = SimpleNamespace(**{n: counted(n) for n in names})
    monkeypatch.setattr(loading, "_cpu_kernels", spy)
    on_kernels = _greedy(make_engine())
    layers = make_engine().model.config.num_layers
    assert calls["paged_decode"] >= 23 * layers  # every decode step, every layer
    assert calls["add_rms_norm"] >= 24 * (2 * layers + 1)  # prefill and decode steps
    assert calls["rope_store"] >= 24 * layers
    assert calls["silu_mul"] >= 24 * layers
    monkeypatch.setattr(loading, "_cpu_kernels", None)
    assert _greedy(make_engine()) == on_kernels


def _rope_problem(dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 + 2 * 3, 64, generator=gen).to(dtype)
    angles = torch.rand(tokens, 32, generator=gen) * 100
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    slots = torch.randperm(8 * BLOCK, generator=gen)[:tokens]
    k_cache = torch.zeros(8, BLOCK, 3, 64, dtype=dtype)
    return qkv, cos, sin, slots, k_cache, torch.zeros_like(k_cache)


@pytest.mark.parametrize("tokens", [1, 5, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_apply_rope_and_write_kv(tokens: int, dtype: torch.dtype) -> None:
    qkv, cos, sin, slots, k_cache, v_cache = _rope_problem(dtype, tokens)
    rotated = apply_rope(qkv[:, :12], cos, sin)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, rotated[:, 9:], qkv[:, 12:], slots)
    got = qkv.clone()
    cpu_kernels.rope_store(got, cos, sin, slots, k_cache, v_cache, heads=9)
    # One rounding of x1 cos - x2 sin, where torch rounds the product first: 1 step apart.
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got[:, :12], rotated, atol=tolerance, rtol=tolerance)
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # values are not rotated
    torch.testing.assert_close(k_cache, want_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(v_cache, want_v)  # the same slots, and only them


def test_rope_store_refuses_slots_outside_the_cache_and_odd_shapes() -> None:
    qkv, cos, sin, slots, k_cache, v_cache = _rope_problem(torch.float32, 3)
    for bad in (torch.tensor([0, 1, 8 * BLOCK]), torch.tensor([0, -1, 2])):
        with pytest.raises(ValueError, match="outside the cache"):
            cpu_kernels.rope_store(qkv, cos, sin, bad, k_cache, v_cache, heads=9)
    with pytest.raises(ValueError, match="not 8 \\+ 2 x 3"):
        cpu_kernels.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads=8)
    with pytest.raises(ValueError, match="are not"):
        cpu_kernels.rope_store(qkv, cos[:2], sin[:2], slots, k_cache, v_cache, heads=9)
    with pytest.raises(ValueError, match="slots"):
        cpu_kernels.rope_store(qkv, cos, sin, slots.int(), k_cache, v_cache, heads=9)
    half = (t.half() for t in (qkv, cos, sin))
    assert not cpu_kernels.rope_store_takes(*half, slots, k_cache.half(), v_cache.half())
    assert not cpu_kernels.rope_store_takes(qkv, cos, sin, slots, k_cache.bfloat16(), v_cache)


FMA_LEVELS = [level for level in cpu_kernels.cpu_levels() if level != "generic"]


@pytest.mark.skipif(len(FMA_LEVELS) < 2, reason="this CPU runs one level with FMA; needs two")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_with_fma_attends_and_normalizes_to_the_same_bits(
    dtype: torch.dtype,
) -> None:
    """A vec is one register of its build (vec.h) but sums across lanes keep 16 logical
    lanes, so AVX2 and AVX-512 add in the same order (the generic x86-64 build has no
    fused multiply-add and rounds each product: it may differ in the last bit)."""
    problems = [
        _decode_problem([15, 16, 17, 33, 100], 9, 3, 64, dtype, seed=3),
        _decode_problem([64, 130, 5], 32, 8, 128, dtype, seed=4),
    ]
    gen = torch.Generator().manual_seed(5)
    x, residual, weight = (torch.randn(7, 576, generator=gen).to(dtype) for _ in range(3))
    before = cpu_kernels.level()
    results = {}
    try:
        for level in FMA_LEVELS:
            cpu_kernels.select(level)
            attended = [cpu_kernels.paged_decode(*problem, 0.125) for problem in problems]
            summed = residual.clone()
            normed, _ = cpu_kernels.add_rms_norm(x, summed, weight[0], 1e-5)
            results[level] = [*attended, summed, normed]
    finally:
        cpu_kernels.select(before or "auto")
    first, *others = results.values()
    for level, got in zip(FMA_LEVELS[1:], others, strict=True):
        for a, b in zip(first, got, strict=True):
            assert torch.equal(a, b), f"{FMA_LEVELS[0]} and {level} differ"
