"""Loading a draft model beside a worker's target: the files, a check that both share one
vocabulary, the model on the target's device, and its KV pool carved out of the
target's (draft_kv.py says how much); or, with speculative.draft_device, the model and a
pool as large as the target's on a device of its own.

In a tensor-parallel worker the draft runs whole (unsharded) in the leader alone: only
the leader schedules, and drafts are asked for at schedule time, so a copy on each
follower would never run. The leader's target pool shrinks to make room for the draft's
and the followers' pools shrink to the same block count (every shard's pool holds the
same blocks: the leader's block tables index them all)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer as RawTokenizer

from appliance.engine.shard_loading import (
    ShardParts,
    activation_dtype,
    build_model,
    resolve_device,
    use_quant,
)
from appliance.engine.speculative.adaptive import AdaptivePolicy
from appliance.engine.speculative.draft_kv import split_pool
from appliance.engine.speculative.draft_model import DraftModelProposer
from appliance.engine.speculative.proposer import Drafter
from appliance.kv.cache import KVCache, KVLayout, resolve_kv_dtype
from appliance.model import cpu_kernels
from appliance.model.causal_lm import CausalLM
from appliance.model.loader import ModelFiles, load_model_files
from appliance.model.quant import QuantEmbedding, QuantLinear, use_prefill_gemm
from appliance.settings.config import Settings


class Followers(Protocol):
    """A tensor-parallel leader's other shards (llm_engine.ShardGroup), as seen here."""

    size: int  # the shards, the leader's included

    def resize_kv(self, num_blocks: int) -> None: ...


def engine_drafter(
    settings: Settings, parts: ShardParts, decodes: bool, group: Followers | None = None
) -> tuple[ShardParts, Drafter | None]:
    """The drafter speculative.* asks for, and the target's parts to build the engine
    from: for method "draft" on a decoding worker the draft model is loaded and the
    target's pool shrunk to make room for the draft's. A prefill worker never drafts
    (its sequences park after their first token): it loads no draft.

    group: a tensor-parallel leader's followers; their pools get the leader's new block
    count, and the draft's cost is weighed against a shard's part of the target."""
    spec = settings.speculative
    if spec.method != "draft":
        return parts, Drafter.from_settings(spec)
    if not decodes:
        return parts, None
    assert spec.draft_model is not None  # the settings' validator says so
    draft_files = load_model_files(spec.draft_model, settings.cache_dir)
    parts, draft = load_draft(settings, draft_files, parts)
    shards = 1
    if group is not None:
        group.resize_kv(parts.kv.num_blocks)
        shards = group.size
    drafter = Drafter.from_settings(spec, draft)
    if drafter is not None and drafter.policy is not None:
        # A draft token costs a draft step besides its verify row: while decode is bound by
        # the bytes of weights read, a step of the draft costs its files' share of what a
        # target step reads (a shard's part: the shards read theirs at once, the whole
        # draft runs in the leader alone). The adaptive rule pauses a sequence whose
        # acceptance does not pay both (a draft as large as the target never pays).
        share = shards * file_bytes(draft_files) / max(1, file_bytes(parts.files))
        cost = min(1.0, drafter.policy.verify_token_cost + share)
        drafter = replace(drafter, policy=AdaptivePolicy(cost))
    return parts, drafter


def load_draft(
    settings: Settings, files: ModelFiles, parts: ShardParts
) -> tuple[ShardParts, DraftModelProposer]:
    """The draft model of `files` on the target's device (or speculative.draft_device),
    its proposer, and the target's parts with the pool it now shares (split_pool) where
    both live on one device."""
    check_vocabulary(files, parts.files)
    device = draft_device(settings.speculative.draft_device, parts.model.device)
    model = build_draft(settings, files, device, parts.max_len)
    target = parts.kv
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, model.dtype, model.device)
    if kv_dtype != model.dtype:
        model.decode_step = None  # the compiled step reads and writes K/V in one dtype
    cfg = files.config
    layout = KVLayout(cfg.num_layers, target.block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    if settings.kv.num_blocks or device != parts.model.device:
        # An exact count is the target's, and a draft on a device of its own takes
        # nothing from the target's memory: the draft's pool adds as many blocks (every
        # sequence the target holds, the draft holds too).
        blocks = target.num_blocks
    else:
        taken = weight_bytes(model) if _sized_by_gpu_share(settings, model) else 0
        blocks = split_pool(
            target.num_blocks, target.layout.bytes_per_block(), layout.bytes_per_block(), taken
        )
        parts = replace(parts, kv=smaller_pool(target, blocks))
    kv = KVCache(layout, blocks, model.device)
    return parts, DraftModelProposer(model, kv, settings.batch.chunk_size)


def draft_device(name: str | None, target: torch.device) -> torch.device:
    """The device speculative.draft_device names (None: the target's); a ValueError
    naming the setting where this process has no such device."""
    if name is None:
        return target
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            seen = f"{count} CUDA device{'s' * (count != 1)}" if count else "no CUDA device"
            raise ValueError(f"speculative.draft_device is {name}, but torch sees {seen}")
        device = torch.device("cuda", index)
    return device


def check_vocabulary(draft: ModelFiles, target: ModelFiles) -> None:
    """Raise ValueError naming both models unless the draft's tokenizer maps every token
    to the target's id and its logits cover the same vocabulary: a draft token is
    verified as the target's token of that id."""
    ours = _vocabulary(draft.tokenizer_dir)
    theirs = _vocabulary(target.tokenizer_dir)
    problem = ""
    if draft.config.vocab_size != target.config.vocab_size:
        problem = (
            f"its vocabulary has {draft.config.vocab_size} tokens, the target's "
            f"{target.config.vocab_size}"
        )
    elif ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))
        token = differ[0][0]
        problem = (
            f"its tokenizer differs from the target's ({len(ours)} and {len(theirs)} "
            f"tokens; {token!r} is id {ours.get(token)} in the draft, {theirs.get(token)} "
            "in the target)"
        )
    if problem:
        raise ValueError(
            f"speculative.draft_model {draft.source} cannot draft for {target.source}: "
            f"{problem}. A draft model must share the target's tokenizer."
        )


def _vocabulary(folder: Path) -> dict[str, int]:
    """Every token of the tokenizer.json in `folder`, added tokens included, to its id."""
    return RawTokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)


def build_draft(
    settings: Settings, files: ModelFiles, device: torch.device, max_len: int
) -> CausalLM:
    """The draft on `device` as load_shard builds a target (block-format weights where
    weights allows them, never forced: weights=quantized is the target's demand), up to
    the target's context or the draft's own if shorter (longer sequences get no drafts)."""
    weights = "dense" if settings.weights == "dense" else "auto"
    quantized = use_quant(settings.model_copy(update={"weights": weights}), files, device)
    dtype = activation_dtype(settings.dtype, quantized, resolve_device(str(device)))
    positions = min(max_len, files.config.max_position_embeddings)
    model = build_model(files, dtype, device, positions, quantized, quantize_to=settings.quantize)
    if quantized:
        gemm = cpu_kernels.prefill_gemm_dtype(settings.prefill_gemm)
        use_prefill_gemm(
            model, gemm, cpu_kernels.prefill_gemm_rows(settings.prefill_gemm_rows, gemm)
        )
    return model


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the model's weights: its parameters and buffers, and the blocks (and
    biases) of its quantized projections and embedding, plain attributes that
    parameters() does not see; a table two modules share (a tied head's) counted once."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, QuantLinear):  # its blocks: QuantLinear.weight_bytes
            tensors += [part.blocks for part in module.parts]
            tensors += [] if module.bias is None else [module.bias]
        elif isinstance(module, QuantEmbedding):
            tensors.append(module.weight_q.blocks)
    unique = {(t.device, t.data_ptr()): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def file_bytes(files: ModelFiles) -> int:
    """The size of a model's weight files: a GGUF, or a folder's safetensors."""
    if files.source.is_file():
        return files.source.stat().st_size
    return sum(path.stat().st_size for path in files.source.glob("*.safetensors"))


def _sized_by_gpu_share(settings: Settings, model: CausalLM) -> bool:
    """Whether the target's pool was sized from the GPU's memory share (measured before
    the draft's weights were loaded), rather than from kv.memory_mb."""
    return model.device.type == "cuda" and not settings.kv.memory_mb_given


def smaller_pool(pool: KVCache, blocks: int) -> KVCache:
    """`pool` remade with `blocks` blocks (shared memory if it was); `pool` itself if it
    has that many already."""
    if blocks == pool.num_blocks:
        return pool
    layout, device, shared = pool.layout, pool.tensor.device, pool.tensor.is_shared()
    pool.tensor = torch.empty(0)  # its memory goes before the smaller pool is made
    return KVCache(layout, blocks, device, shared=shared)
