"""Mistral's sliding window: each query sees its last `sliding_window` keys, itself
included, as transformers' mask does, on every path a step can take (SDPA prefill,
chunked prefill over cached blocks, the compiled CPU decode kernel until the window cuts
a context, SDPA decode after) and on the compiled quantized decode step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from random_models import (
    TOY_TOKENS,
    assert_matches,
    assert_shards_match,
    greedy,
    our_engine,
    random_model,
    save_folder,
    served_completions,
    token_prompts,
    write_gguf,
)

from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.errors import ModelLoadError
from appliance.model.layers.paged_attention import DecodeGroup, sdpa_decode
from appliance.model.registry import from_hf_config

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

WINDOW = 24
HEAD_DIM = 64  # a head size the compiled decode kernel takes, so its fallback is exercised


def mistral_config(vocab: int, window: int | None = WINDOW):
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        sliding_window=window,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return random_model(mistral_config(49152))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, reference: torch.nn.Module) -> Path:
    return save_folder(reference, tmp_path_factory.mktemp("mistral"), shard_size="1MB")


def test_the_window_changes_the_answer(reference: torch.nn.Module) -> None:
    """The check below means something: unwindowed, the same weights answer otherwise."""
    unwindowed = random_model(mistral_config(49152, window=None))
    prompt = token_prompts(49152, [60])[0]
    assert greedy(reference, prompt, 16) != greedy(unwindowed, prompt, 16)


def test_windowed_mistral_matches_transformers(folder: Path, reference: torch.nn.Module) -> None:
    ours = our_engine(folder)
    assert ours.model.config.sliding_window == WINDOW
    # Shorter and longer than the window; 32 new tokens take every one past it.
    prompts = token_prompts(49152, [5, 20, 24, 25, 40, 90])
    prompts.append(ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi " * 30}]))
    assert_matches(ours, reference, prompts)


def test_chunked_prefill_over_cached_blocks_keeps_the_window(
    folder: Path, reference: torch.nn.Module
) -> None:
    ours = our_engine(folder, batch={"chunk_size": 16, "max_num_batched_tokens": 64})
    prompts = token_prompts(49152, [70, 33], seed=1)
    completions = ours.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == greedy(reference, prompt, 24)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
def test_compiled_decode_step_keeps_the_window(tmp_path: Path) -> None:
    """A block-quantized GGUF (llama layout, as llama.cpp writes Mistral) whose metadata
    has the window: the compiled step runs decodes until the window cuts a context, then
    the layers, and answers as the layers alone do."""
    vocab = len(TOY_TOKENS)
    model = random_model(mistral_config(vocab))
    metadata: dict[str, int | float] = {
        "block_count": 2,
        "context_length": 512,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.sliding_window": WINDOW,
        "vocab_size": vocab,
    }
    path = write_gguf(model, tmp_path / "m.gguf", gguf.MODEL_ARCH.LLAMA, metadata, quantize=True)
    compiled = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    assert compiled.model.config.sliding_window == WINDOW
    assert compiled.model.decode_step is not None
    layers = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    layers.model.decode_step = None
    prompts = token_prompts(vocab, [4, 10, 30])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == [c.token_ids for c in layers.generate(prompts, params)]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": "24"}, "sliding_window"),
    ],
)
def test_a_bad_window_is_refused(fields: dict, words: str) -> None:
    cfg = mistral_config(100).to_dict() | fields
    with pytest.raises(ModelLoadError, match=words):
        from_hf_config(cfg, "m")


def test_qwen_sliding_layers_are_refused_not_ignored() -> None:
    from transformers import Qwen2Config

    cfg = Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=1).to_dict()
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        from_hf_config(cfg, "q")


def test_windowed_tensor_parallel_shards_match_transformers(
    folder: Path, reference: torch.nn.Module
) -> None:
    prompts = token_prompts(49152, [10, 30, 75], seed=2)
    assert_shards_match(folder, prompts, [reference] * len(prompts))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_appliance_serve_keeps_the_window(
    folder: Path, reference: torch.nn.Module, mode: str
) -> None:
    """`appliance serve` (prefill and decode pools, the KV cache handed between them, or
    colocated workers) answers prompts longer than the window as transformers does."""
    from transformers import AutoTokenizer

    prompts = token_prompts(49152, [30, 60], seed=3)
    texts = served_completions(folder, {"APPLIANCE_MODE": mode}, prompts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert texts == [tokenizer.decode(greedy(reference, p, 24)) for p in prompts]


def _windowed_problem(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Caches in shuffled blocks of 16 and one query per sequence, viewed out of a wider
    row as the model's q is."""
    gen = torch.Generator().manual_seed(len(lens) + head_dim)
    width = max(-(-n // 16) for n in lens)
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    return qk[:, :heads], k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("window", [1, 5, 16, 24, 33, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_reads_only_the_window(window: int, dtype: torch.dtype) -> None:
    """The compiled decode attention at every level this CPU runs, against SDPA masked to
    the window, with contexts around block edges and the window's."""
    problems = [
        _windowed_problem([1, 15, 16, 17, 24, 25, 33, 100], 9, 3, 64, dtype),
        _windowed_problem([64, 130, 5], 32, 8, 128, dtype),
    ]
    before = cpu_kernels.level()
    try:
        for level in cpu_kernels.cpu_levels():
            cpu_kernels.select(level)
            for q, k_cache, v_cache, tables, lens in problems:
                keys = torch.arange(tables.shape[1] * 16)
                visible = (keys[None, :] < lens[:, None])[:, None, None, :]
                group = DecodeGroup(None, tables, visible, lens)
                want = sdpa_decode(q.contiguous(), k_cache, v_cache, group, 0.125, window)
                got = cpu_kernels.paged_decode(
                    q, k_cache, v_cache, tables, lens, 0.125, window=window
                )
                tolerance = 1e-5 if dtype == torch.float32 else 8e-3
                torch.testing.assert_close(
                    got.float(), want.float(), atol=tolerance, rtol=tolerance
                )
    finally:
        cpu_kernels.select(before or "auto")


# Run by a child Python with TRITON_INTERPRET=1 (set before triton is imported: see
# tests/test_triton_attention.py): the Triton kernel with a window against float64 SDPA
# masked the same way; prints each case's largest error over 1 + |reference|.
_TRITON_CHILD = r"""
import json
import torch
from appliance.model.layers.triton_attention import paged_attention

def case(runs, window, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    lens = [cached + new for cached, new in runs]
    width = max(-(-n // bs) for n in lens)
    blocks = len(runs) * width + 2
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(runs) * width].view(len(runs), width)
    news = [new for _, new in runs]
    q = torch.randn(sum(news), heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    got = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, query_len=max(news),
        query_starts=starts, window=window,
    )
    worst = 0.0
    for i, (cached, new) in enumerate(runs):
        keys = lambda c: c.index_select(0, tables[i]).flatten(0, 1)[: lens[i]].double()
        k, v = keys(k_cache), keys(v_cache)  # [len, kv_heads, dim]
        rows = q[starts[i] : starts[i + 1]].double()  # [new, heads, dim]
        q_pos = torch.arange(cached, cached + new)[:, None]
        k_pos = torch.arange(lens[i])[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        want = torch.nn.functional.scaled_dot_product_attention(
            rows.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            scale=0.125, enable_gqa=True,
        ).transpose(0, 1)
        error = (got[starts[i] : starts[i + 1]].double() - want).abs() / (1 + want.abs())
        worst = max(worst, error.nan_to_num(nan=float("inf")).max().item())  # NaN: a failure
    return worst

decodes = [(0, 1), (15, 1), (16, 1), (23, 1), (24, 1), (69, 1), (138, 1)]
chunks = [(0, 33), (37, 20), (64, 5), (3, 90), (130, 1)]
out = {}
for window in (1, 5, 24, 64, 100):
    out[f"decode_w{window}"] = case(decodes, window, torch.float32, window)
    out[f"chunks_w{window}"] = case(chunks, window, torch.float32, window + 1)
out["decode_w24_bf16"] = case(decodes, 24, torch.bfloat16, 7)
print(json.dumps(out))
"""


def test_the_triton_kernel_reads_only_the_window() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-4000:]}"
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, error in errors.items():
        assert error < (1e-2 if "bf16" in name else 1e-5), (name, error)
