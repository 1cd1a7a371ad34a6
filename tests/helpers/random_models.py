"""Small random-weight transformers models saved as Hugging Face folders or GGUF files,
and the check that our engine answers as transformers does on them (float32).

TOY_TOKENS and TOY_MERGES (gguf_builder's toy tokenizer) stay importable from here."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import gguf_builder
import numpy as np
import torch
from gguf_builder import TOY_MERGES as TOY_MERGES  # re-exported: tests import it from here
from gguf_builder import TOY_TOKENS as TOY_TOKENS
from gguf_builder import MetadataValue, Tensor, toy_tokenizer
from openai import OpenAI
from reference import our_prefill_logits
from server_process import API_KEY, ServerProcess

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.engine.shard_loading import ShardParts, load_shard
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.model.model_source import prepare_model
from appliance.model.tensor_parallel import Shard
from appliance.settings.config import Settings, load_settings

LOGIT_TOLERANCE = 1e-3  # float32 prefill logits, ours against transformers'


def tiny_llama_config(vocab: int, context: int = 256) -> Any:
    """A two-layer llama of `vocab` tokens (tied embeddings, grouped KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )


def random_model(config: Any) -> torch.nn.Module:
    """transformers' model for `config` with seeded random float32 weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_folder(model: torch.nn.Module, folder: Path, *, shard_size: str | None = None) -> Path:
    """A Hugging Face folder of `model` (sharded safetensors with
    model.safetensors.index.json when `shard_size` is given) with the embedded model's
    tokenizer, which has the 49152-token vocabulary the random models are built with."""
    if shard_size is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=shard_size)
    tokenizer_dir = prepare_model(None, load_settings().cache_dir)[1]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    arch: gguf.MODEL_ARCH,
    metadata: Mapping[str, MetadataValue],
    *,
    quantize: bool = False,
    extra: Mapping[str, np.ndarray] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """`model` as a GGUF of architecture `arch` with the toy tokenizer (its vocabulary
    must be len(TOY_TOKENS)), written by gguf_builder.write_gguf: tensor names from the
    gguf package's own map, matrices in Q8_0 blocks when `quantize`, else float32; Gemma
    3's norm weights as 1 + weight, as convert_hf_to_gguf stores them; `extra` tensors
    (float32, by GGUF name) after the model's; `tensors` (by Hugging Face name) in place
    of the model's state dict, `types` (by the same names) the block formats some are
    stored in (gpt-oss's MXFP4 experts). Metadata keys lack the "<arch>." prefix."""
    state = model.state_dict() if tensors is None else tensors
    arrays = gguf_tensors(model, state, arch, metadata, quantize=quantize, types=types or {})
    for gguf_name, array in (extra or {}).items():
        arrays[gguf_name] = np.ascontiguousarray(array, dtype=np.float32)
    name = gguf.MODEL_ARCH_NAMES[arch]
    return gguf_builder.write_gguf(path, arrays, arch=name, metadata=metadata, **toy_tokenizer())


def gguf_tensors(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    arch: gguf.MODEL_ARCH,
    metadata: Mapping[str, MetadataValue],
    *,
    quantize: bool,
    types: Mapping[str, gguf.GGMLQuantizationType],
) -> dict[str, Tensor]:
    """`state` (Hugging Face names) under GGUF names, as convert_hf_to_gguf stores it."""
    names = gguf.get_tensor_name_map(arch, int(metadata["block_count"]))
    tied = bool(model.config.tie_word_embeddings)
    arrays: dict[str, Tensor] = {}
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":  # a GGUF without output.weight is tied
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf has no name for {hf_name}")
        array = tensor.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = metadata[
                "attention.head_count" if "q_proj" in hf_name else "attention.head_count_kv"
            ]
            array = _permute_rope_rows(array, int(heads))
        if arch == gguf.MODEL_ARCH.GEMMA3 and hf_name.endswith("norm.weight"):
            array = array + 1
        qtype = types.get(hf_name)
        if qtype is None and quantize and array.ndim >= 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
        if qtype is None:
            arrays[gguf_name] = np.ascontiguousarray(array)
        else:
            arrays[gguf_name] = (gguf.quants.quantize(array, qtype), qtype)
    return arrays


def _permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for a llama GGUF (convert_hf_to_gguf's permute)."""
    rows = weight.shape[0]
    # [heads, 2, half, in] -> [heads, half, 2, in]
    shaped = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def our_engine(model: Path, cache_dir: Path | None = None, **settings: Any) -> LLMEngine:
    """Our float32 CPU engine for a folder or GGUF."""
    extra = {"cache_dir": cache_dir} if cache_dir is not None else {}
    fields = {"dtype": "float32", "device": "cpu", "kv": {"num_blocks": 128}}
    return LLMEngine.from_settings(load_settings(model=model, **(fields | extra | settings)))


def greedy(reference: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """transformers' greedy continuation, exactly `tokens` long (no stop at EOS)."""
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_matches(
    ours: LLMEngine, reference: torch.nn.Module, prompts: list[list[int]], tokens: int = 32
) -> float:
    """Our prefill logits within LOGIT_TOLERANCE of transformers' and our greedy tokens
    equal to its, for every prompt (batched together); returns the largest logit error."""
    worst = 0.0
    with torch.inference_mode():
        for prompt, logits in zip(prompts, our_prefill_logits(ours, prompts), strict=True):
            expected = reference(torch.tensor([prompt])).logits[0].float()
            worst = max(worst, (logits - expected).abs().max().item())
    assert worst < LOGIT_TOLERANCE, f"prefill logits differ by {worst}"
    completions = ours.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == greedy(reference, prompt, tokens), f"prompt {prompt[:8]}"
    assert ours.num_free_blocks == ours.kv.num_blocks
    return worst


def assert_shards_match(
    folder: Path, prompts: list[list[int]], references: list[torch.nn.Module]
) -> None:
    """Two tensor-parallel shards' prefill logits of each prompt within LOGIT_TOLERANCE of
    its reference's (transformers', one reference per prompt)."""
    logits = sharded_prefill_logits(folder, our_engine(folder), prompts, 2)
    for prompt, got, reference in zip(prompts, logits, references, strict=True):
        expected = reference(torch.tensor([prompt])).logits[0].float()
        assert (got - expected).abs().max().item() < LOGIT_TOLERANCE


def served_completions(
    folder: Path, env: Mapping[str, str], prompts: list[list[int]], tokens: int = 24
) -> list[str]:
    """Greedy texts `appliance serve` (float32, a 32 MB KV pool, `env` on top) gives for
    token prompts, through the official client; the server is stopped after."""
    server = ServerProcess(
        {
            "APPLIANCE_MODEL": str(folder),
            "APPLIANCE_DTYPE": "float32",
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_KV__MEMORY_MB": "32",
        }
        | dict(env)
    )
    server.start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        replies = [
            client.completions.create(
                model=folder.name,
                prompt=prompt,
                max_tokens=tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for prompt in prompts
        ]
    finally:
        server.stop()
    return [reply.choices[0].text for reply in replies]


def token_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of these lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


class LockstepSum:
    """An all-reduce for shards run as threads of this process: each waits for all."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            parts = [p for p in self.parts if p is not None]
            total = sum(parts[1:], parts[0].clone())  # the same order on every rank
            self.barrier.wait()
            return x.copy_(total)

        return reduce


def sharded_prefill_logits(
    model: Path, whole: LLMEngine, prompts: list[list[int]], size: int, **more: Any
) -> list[torch.Tensor]:
    """All-position logits of one batched prefill of `prompts`, computed by `size`
    tensor-parallel shards of `model` (float32, CPU) in lockstep threads; `whole` (our
    engine of the same model) lays out the step; `more`: settings beside those."""
    fields = {"dtype": "float32", "device": "cpu", "kv": {"num_blocks": 64}, "prefill_tp": size}
    settings = load_settings(model=model, **(fields | more))
    hidden, first = sharded_prefill(settings, whole, prompts, size)
    logits = first.model.logits(hidden[0])
    return list(logits.split([len(p) for p in prompts]))


def sharded_prefill(
    settings: Settings, whole: LLMEngine, prompts: list[list[int]], size: int
) -> tuple[list[torch.Tensor], ShardParts]:
    """One batched prefill of `prompts` by `size` tensor-parallel shards of the model
    `settings` name, run as lockstep threads of this process summing through a
    LockstepSum: every rank's hidden states ([tokens of all prompts, hidden]) and the
    first shard (for its logits). `whole` (our engine of the same model) lays out the
    step."""
    summed = LockstepSum(size)
    parts = [load_shard(settings, Shard(r, size), summed.for_rank(r)) for r in range(size)]
    seqs = [Sequence(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    start = 0
    for seq in seqs:  # the same blocks in every shard's pool
        count = blocks_for_tokens(len(seq), whole.kv.block_size)
        seq.block_table = list(range(start, start + count))
        start += count
    inputs = whole.runner.prepare(
        SchedulerOutput(prefills=[ScheduledChunk(s, len(s)) for s in seqs])
    )
    hidden: list[torch.Tensor | None] = [None] * size

    def run(rank: int) -> None:
        shard = parts[rank]
        hidden[rank] = shard.model(
            inputs.input_ids, inputs.positions, inputs.attention, shard.kv.tensor
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [h for h in hidden if h is not None]
    if len(done) < size:
        raise RuntimeError("a shard computed nothing (see the thread's traceback)")
    return done, parts[0]
