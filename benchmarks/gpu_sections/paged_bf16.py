"""Section 2, paged_bf16: the engine's bfloat16 paged steps on the default model (a chunked
long prefill, a prefix-cache hit, short prompts beside running decodes, mixed-length
decodes), every row's logits against a dense transformers model on the same weights in
float32 (the truth) and bfloat16 (the error bfloat16 itself makes); which attention
backend ran. On cuda:0, or the CPU in the dry run."""

from __future__ import annotations

import importlib.metadata
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .common import Result, random_ids, settings_for, verdict
from .measure import free_memory, peak_tracker
from .scale import Scale

if TYPE_CHECKING:
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.scheduler import SchedulerOutput


# A row of captured logits: (sequence id, first position, logits [rows, vocab]).
Captured = dict[int, list[tuple[int, torch.Tensor]]]
Logits = Callable[[list[int]], torch.Tensor]
# The bfloat16 engine may err by this much more than a dense bfloat16 model does, both
# measured against the float32 one: a factor for rounding in another order (fused
# projections, an online softmax, a paged gather) and a floor for rows where the dense
# model happens to be near exact. Rows are compared as log-probabilities: a row of logits
# counts only up to a shift (sampling and the API's logprobs see its softmax), and
# bfloat16 rounding shifts whole rows (on an Intel Xeon with AMX, one early position of
# a short prompt: every logit 1.19 low, 0.16 apart from the shift, dense 0.10). Rows
# are compared in pairs (same tokens, same position) by their mean |dlogprob|: some
# positions err more in any bfloat16 model, while a wrong block, slot or position errs
# by whole units on every row it touches (`--inject-fault` zeroes 16 cached keys of the
# long prompt's first chunk: its rows err by up to 3.4, dense by 0.1).
MEAN_FACTOR, MEAN_FLOOR = 2.5, 0.01  # on the mean |dlogprob| over all rows of a kind
ROW_FACTOR, ROW_FLOOR = 3.0, 0.5  # on each row's mean |dlogprob|, against the same row's
MAX_FACTOR, MAX_FLOOR = 3.0, 0.5  # on the largest single |dlogprob| (NaN fails)
TOP1_SLACK = 0.03  # fewer rows may pick float32's top token than dense bf16: 3%, at least 2


class ErrorStats:
    """Differences of rows of logits from the reference's, as log-probabilities,
    accumulated over batches; after `pair`, also the rows that err beyond ROW_FACTOR x
    another model's same row + ROW_FLOOR."""

    def __init__(self) -> None:
        self.rows = self.elements = self.top1_same = self.rows_over = 0
        self.max_abs = self.sum_abs = 0.0
        self.worst_excess = -math.inf
        self.worst_row = ""

    def add(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Take rows [n, vocab] against the reference's; returns each row's mean |diff|."""
        diff = (got.float().log_softmax(-1) - want.float().log_softmax(-1)).abs()  # [n, vocab]
        self.rows += got.shape[0]
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.elements += diff.numel()
        self.top1_same += int((got.argmax(-1) == want.argmax(-1)).sum())
        return diff.mean(-1)

    def pair(self, mine: torch.Tensor, theirs: torch.Tensor, where: list[str]) -> None:
        """Row errors against another model's on the same rows (described by `where`)."""
        excess = mine - (ROW_FACTOR * theirs + ROW_FLOOR)
        self.rows_over += int((excess > 0).sum())
        worst = int(excess.argmax())
        if float(excess[worst]) > self.worst_excess:
            self.worst_excess = float(excess[worst])
            self.worst_row = (
                f"{where[worst]}: {float(mine[worst]):.3f} vs {float(theirs[worst]):.3f}"
            )

    def summary(self) -> dict[str, Any]:
        paired = {"rows_over_bound": self.rows_over, "worst_row": self.worst_row}
        return {
            "rows": self.rows,
            "mean_abs": round(self.sum_abs / max(self.elements, 1), 5),
            "max_abs": round(self.max_abs, 4),
            "top1_same": self.top1_same,
            **(paired if self.worst_row else {}),
        }


def section_paged_bf16(scale: Scale) -> Result:
    """The engine's paged bfloat16 steps as its scheduler makes them (a chunked long
    prefill; a prompt whose prefix the cache holds; short prompts, a one-token one among
    them, prefilled beside running decodes; then decodes of mixed context lengths), every
    row's logits against a dense model without paging, in float32 (the truth) and in
    bfloat16 (the error bfloat16 itself makes)."""
    from appliance.model.layers import paged_attention as attention

    tracker = peak_tracker(scale.device)
    engine = engine_for(scale, "bfloat16", chunk=scale.chunk_size, memory_mb=1024)
    calls = count_attention_calls(scale.device)
    seqs, captured, chunks = paged_scenario(engine, scale)
    peak = tracker()
    all_free = engine.num_free_blocks == engine.kv.num_blocks
    name, truth, floor = dense_references(engine, scale)
    ours, dense = compare_rows(seqs, captured, truth, floor)
    checks = tolerance_checks(ours, dense)
    checks["the long prompt ran in several chunks"] = chunks >= 3
    checks["the second prompt found its prefix in the cache"] = (
        seqs["prefix_hit"].num_cached_tokens == scale.prefix_tokens
    )
    checks["every KV block is free after"] = all_free
    triton = attention.runs_triton(scale.device)
    if scale.cuda:
        checks["attention ran the Triton kernel on CUDA"] = triton and calls["triton"] > 0
        checks["and nothing else"] = calls["sdpa_prefill"] + calls["torch_decode"] == 0
    means = ", ".join(f"{k} {v['mean_abs']} ({dense[k]['mean_abs']})" for k, v in ours.items())
    return verdict(
        checks,
        summary=f"mean |dlogprob| vs float32 (dense bf16's): {means}; attention "
        f"{'triton' if triton else 'torch/C kernels'}",
        reference=name,
        engine_vs_float32=ours,
        dense_bf16_vs_float32=dense,
        tolerance={
            "mean_abs": f"<= {MEAN_FACTOR} x dense bf16's + {MEAN_FLOOR}",
            "each row's mean_abs": f"<= {ROW_FACTOR} x dense bf16's same row + {ROW_FLOOR}",
            "max_abs": f"<= {MAX_FACTOR} x dense bf16's + {MAX_FLOOR}",
            "top1_same": f">= dense bf16's - max(2, {TOP1_SLACK} x rows)",
        },
        attention={"runs_triton": triton, "calls": dict(calls)},
        long_prompt_chunks=chunks,
        peak_mib_engine_and_steps=peak,
    )


def engine_for(scale: Scale, dtype: str, chunk: int, memory_mb: int) -> LLMEngine:
    """An in-process engine on the scale's device with an explicit KV budget (on a GPU the
    default would take 90% of the device)."""
    from appliance.engine.llm_engine import LLMEngine

    batch = {"chunk_size": chunk, "max_num_batched_tokens": 4 * chunk}
    kv = {"memory_mb": memory_mb}
    return LLMEngine.from_settings(settings_for(scale, dtype, batch=batch, kv=kv))


def count_attention_calls(device: torch.device) -> Counter:
    """Count, from now on in this process, which attention implementation each layer
    calls: the Triton kernel, SDPA prefill, or the CPU/SDPA decode."""
    from appliance.model.layers import paged_attention as attention

    calls: Counter = Counter(triton=0, sdpa_prefill=0, torch_decode=0)

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    attention._prefill = counted("sdpa_prefill", attention._prefill)
    attention._decode = counted("torch_decode", attention._decode)
    if attention.runs_triton(device):
        from appliance.model.layers import triton_attention

        triton_attention.attend = counted("triton", triton_attention.attend)
    return calls


def paged_scenario(engine: LLMEngine, scale: Scale) -> tuple[dict[str, Any], Captured, int]:
    """Run the scenario through the engine's scheduler; returns its sequences by role,
    every step's logits by sequence, and how many steps the long prompt's prefill took."""
    from appliance.engine.sequence import SamplingParams, Sequence

    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    captured: Captured = {}
    decode = SamplingParams(max_tokens=scale.decode_tokens, ignore_eos=True)
    longer = SamplingParams(max_tokens=scale.decode_tokens + 4, ignore_eos=True)
    first = Sequence(0, random_ids(rng, scale.long_prompt, vocab), longer)
    seqs: dict[str, Any] = {"chunked_prefill": first}
    engine.scheduler.add(first)
    chunks = run_until(engine, captured, lambda: first.num_computed_tokens > 0)
    if scale.inject_fault:  # keys of the first chunk, read by every later row of `first`
        engine.kv.tensor[:, 0, first.block_table[0], :16] = 0
    chunks += run_until(engine, captured, lambda: bool(first.output_ids))
    # Five tokens past the cached blocks: the match stops at the last whole block.
    shared = first.token_ids[: scale.prefix_tokens + 5]
    second = Sequence(1, shared + random_ids(rng, scale.suffix_tokens, vocab), decode)
    seqs["prefix_hit"] = second
    engine.scheduler.add(second)
    for index, length in enumerate(scale.short_prompts):
        seqs[f"short_{length}"] = Sequence(2 + index, random_ids(rng, length, vocab), decode)
        engine.scheduler.add(seqs[f"short_{length}"])
    run_until(engine, captured, lambda: not engine.scheduler.has_unfinished())
    return seqs, captured, chunks


def run_until(engine: LLMEngine, captured: Captured, done: Callable[[], bool]) -> int:
    """Step the engine until done(); returns the number of steps."""
    steps = 0
    while not done():
        out = engine.scheduler.schedule()
        if out.empty or steps > 1000:
            raise RuntimeError(f"the scheduler stalled after {steps} steps")
        paged_step(engine, out, captured)
        steps += 1
    return steps


def paged_step(engine: LLMEngine, out: SchedulerOutput, captured: Captured) -> None:
    """One engine step as ModelRunner.run makes it, keeping every row's logits (the
    runner keeps only the sampled rows'), then greedy picks fed back to the scheduler."""
    from appliance.engine.model_runner import forward, move_to

    device = engine.model.device
    inputs = engine.runner.prepare(out)
    if device.type != "cpu":
        inputs = move_to(inputs, device)
    logits = engine.model.logits(forward(engine.model, inputs, engine.kv.tensor))
    row = 0
    for chunk in out.chunks:  # prepare's row order: prefill chunks, then decodes
        captured.setdefault(chunk.seq.seq_id, []).append(
            (chunk.start, logits[row : row + chunk.num_tokens])
        )
        row += chunk.num_tokens
    tokens = logits[inputs.sample_rows].argmax(-1).tolist()
    ids = [seq_id for seq_id, _ in inputs.sample_requests]
    engine.scheduler.update_from_output(out, dict(zip(ids, tokens, strict=True)), time.monotonic())


def dense_references(engine: LLMEngine, scale: Scale) -> tuple[str, Logits, Logits]:
    """(name, float32 logits, bfloat16 logits) of a dense model without paging, on the
    engine's weights: transformers' model where it can be built from them, else the
    engine's own model over a whole sequence at once in a fresh pool."""
    from appliance.model.loader import load_model_files

    settings = settings_for(scale, "float32")
    files = load_model_files(settings.model, settings.cache_dir)
    # files.weights reads (and a GGUF's dequantizes) each tensor anew at every access:
    # read once for both models (~1.3 of the dry run's ~12 CPU s in this section).
    weights = {name: t for name, t in files.weights.items() if name != "rope_freqs"}
    try:
        float32 = hf_model(files, weights, scale.device, torch.float32)
        bf16 = hf_model(files, weights, scale.device, torch.bfloat16)
    except Exception as exc:
        logging.warning("transformers cannot build the reference (%s): own model instead", exc)
        own32 = engine_for(scale, "float32", chunk=scale.chunk_size, memory_mb=1024)
        return (
            "the engine's model, whole sequences at once",
            lambda ids: whole_sequence_logits(own32, ids),
            lambda ids: whole_sequence_logits(engine, ids),
        )
    return (
        f"transformers {importlib.metadata.version('transformers')} on the same weights",
        lambda ids: hf_logits(float32, ids, scale.device),
        lambda ids: hf_logits(bf16, ids, scale.device),
    )


def hf_model(
    files: Any, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """transformers' Llama (or Qwen2) with these weights (files' config, its tensors but
    rope_freqs), dense, on `device`; the tensors are taken as they are (assign), so a
    float32 model on the CPU shares them and the tensors are not to be changed."""
    import transformers

    cfg = files.config
    if cfg.rope_scaling:
        raise ValueError(f"RoPE scaling {cfg.rope_scaling['rope_type']} is not mapped here")
    qwen = cfg.architecture == "qwen2"
    config_cls = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM
    hf_config = config_cls(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **({} if qwen else {"attention_bias": cfg.attention_bias}),
    )
    with torch.device("meta"):  # no random init of weights about to be replaced
        model = model_cls(hf_config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rotary = type(model.model.rotary_emb)
    with torch.device(device):  # its inv_freq was made on meta: no data to move
        model.model.rotary_emb = rotary(config=hf_config)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.device(device):  # float32 again: inv_freq in bfloat16 turns long positions
        model.model.rotary_emb = rotary(config=hf_config)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors left on meta: {left[:3]}")
    return model


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    """float32 logits [tokens, vocab] of every position of one sequence."""
    return model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()


def whole_sequence_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The engine's model over a whole sequence in one step, its blocks taken fresh."""
    from appliance.engine.model_runner import forward, move_to
    from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
    from appliance.engine.sequence import SamplingParams, Sequence
    from appliance.kv.block_allocator import blocks_for_tokens

    seq = Sequence(-1, list(ids), SamplingParams())
    seq.block_table = engine.kv.allocator.allocate(
        blocks_for_tokens(len(ids), engine.kv.block_size)
    )
    try:
        out = SchedulerOutput(prefills=[ScheduledChunk(seq, len(seq))])
        inputs = move_to(engine.runner.prepare(out), engine.model.device)
        return engine.model.logits(forward(engine.model, inputs, engine.kv.tensor))
    finally:
        engine.kv.allocator.free(seq.block_table)


def compare_rows(
    seqs: dict[str, Any], captured: Captured, truth: Logits, floor: Logits
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per kind of row (chunked_prefill, prefix_hit, short prefills, decode): the engine's
    and the dense bfloat16 model's errors against float32, and the engine's rows that err
    beyond the bound on the dense model's same row."""
    ours: dict[str, ErrorStats] = {}
    dense: dict[str, ErrorStats] = {}
    for role, seq in seqs.items():
        positions, rows = flat_rows(captured[seq.seq_id])
        ids = seq.token_ids[: int(positions.max()) + 1]
        index = positions.to(rows.device)
        want, bf16 = truth(ids)[index], floor(ids)[index]
        prompt = positions < seq.num_prompt_tokens
        kind = "short_prefill" if role.startswith("short") else role
        for name, mask in ((kind, prompt), ("decode", ~prompt)):
            if mask.any():
                where = [f"{role} position {p}" for p in positions[mask].tolist()]
                mask = mask.to(rows.device)
                mine = ours.setdefault(name, ErrorStats()).add(rows[mask], want[mask])
                theirs = dense.setdefault(name, ErrorStats()).add(bf16[mask], want[mask])
                ours[name].pair(mine, theirs, where)
        free_memory()
    return (
        {name: stats.summary() for name, stats in ours.items()},
        {name: stats.summary() for name, stats in dense.items()},
    )


def flat_rows(pieces: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's captured rows in order: positions [rows] and logits [rows, vocab]."""
    positions = torch.cat([torch.arange(start, start + len(rows)) for start, rows in pieces])
    return positions, torch.cat([rows for _, rows in pieces])


def tolerance_checks(ours: dict[str, dict], dense: dict[str, dict]) -> dict[str, bool]:
    """Each kind of row within the stated tolerance of the dense bfloat16 model's error."""
    checks = {}
    for kind, got in ours.items():
        ref = dense[kind]
        mean_bound = MEAN_FACTOR * ref["mean_abs"] + MEAN_FLOOR
        max_bound = MAX_FACTOR * ref["max_abs"] + MAX_FLOOR
        least = ref["top1_same"] - max(2, math.ceil(TOP1_SLACK * got["rows"]))
        checks |= {
            f"{kind}: mean |dlogprob| {got['mean_abs']} <= {mean_bound:.4g}": (
                got["mean_abs"] <= mean_bound
            ),
            f"{kind}: max |dlogprob| {got['max_abs']} <= {max_bound:.4g}": got["max_abs"]
            <= max_bound,
            f"{kind}: no row's mean |dlogprob| over {ROW_FACTOR} x dense's + {ROW_FLOOR} "
            f"({got['rows_over_bound']} of {got['rows']}; worst {got['worst_row']})": (
                got["rows_over_bound"] == 0
            ),
            f"{kind}: top-1 as float32's in {got['top1_same']} of {got['rows']} rows "
            f"(>= {least})": got["top1_same"] >= least,
        }
    return checks
