"""Speculative decoding with a draft model (speculative.method = "draft"), on tiny random
models over the embedded tokenizer's vocabulary: greedy output with the draft equals
plain decoding token for token; the target drafting for itself is accepted always and a
random draft almost never, and after either every KV block, the target's and the
draft's, is free; a handed-off sequence gets the draft's own prefill; the draft's pool
comes out of the target's budget (a prefill worker loads none); a draft of another
vocabulary is refused at start; and the real SmolLM2 GGUF as the target (its own
tokenizer) with a tiny random draft of its vocabulary answers as plain decoding.
The k = 1..8 matrix: benchmarks/draft_model_bench.py --k-matrix (the slow lane)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from copying_prompt import copying_prompt
from family_configs import tiny_config
from gguf_builder import tiny_gguf_metadata
from pydantic import ValidationError
from random_models import TOY_TOKENS, our_engine, random_model, save_folder, write_gguf

from appliance.engine.llm_engine import Completion, LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.shard_loading import load_shard
from appliance.engine.speculative import draft_loading
from appliance.engine.speculative.draft_loading import (
    build_draft,
    check_vocabulary,
    engine_drafter,
)
from appliance.engine.speculative.draft_model import DraftModelProposer
from appliance.engine.speculative.proposer import Drafter, reported_totals
from appliance.kv.cache import KVCache, KVLayout
from appliance.model.loader import load_model_files
from appliance.model.quant import QuantLinear
from appliance.settings.config import load_settings
from appliance.settings.engine import SpeculativeSettings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): whole models

GREEDY = SamplingParams(max_tokens=24)
POOL = {"num_blocks": 256, "block_size": 4}  # small blocks: rollbacks cross block edges


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target (the TINY llama), a smaller random draft (one layer, half the width),
    and a draft whose vocabulary is not the target's."""
    root = tmp_path_factory.mktemp("draft_models")
    made = {
        "target": tiny_config("LlamaConfig", 49152),
        "draft": tiny_config(
            "LlamaConfig", 49152, num_hidden_layers=1, hidden_size=32, intermediate_size=64
        ),
        "other_vocab": tiny_config("LlamaConfig", 50000, num_hidden_layers=1),
    }
    saved = {name: save_folder(random_model(cfg), root / name) for name, cfg in made.items()}
    # The draft with two tokens' ids swapped in its tokenizer: same size, another map.
    swapped = shutil.copytree(saved["draft"], root / "swapped")
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["t"], vocab["u"] = vocab["u"], vocab["t"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    return saved | {"swapped": swapped}


def drafting(folders: dict[str, Path], draft: str, k: int, **fields: Any) -> LLMEngine:
    """An engine of the target that drafts k tokens with `draft` (a key of folders)."""
    spec = {
        "method": "draft",
        "draft_model": folders[draft],
        "num_speculative_tokens": k,
        "adaptive": False,
    }
    return our_engine(folders["target"], speculative=spec, kv=fields.pop("kv", POOL), **fields)


def prompts_of(engine: LLMEngine) -> list[list[int]]:
    tokenizer = engine.tokenizer
    code = tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    return [copying_prompt(tokenizer), tokenizer.encode("The capital of France is"), code]


def draft_of(engine: LLMEngine) -> DraftModelProposer:
    drafter = engine.scheduler.drafter
    assert drafter is not None and isinstance(drafter.proposer, DraftModelProposer)
    return drafter.proposer


def all_free(engine: LLMEngine) -> bool:
    """Every block of the target's pool and of the draft's free, no sequence tracked."""
    draft = draft_of(engine)
    target_free = engine.num_free_blocks == engine.kv.num_blocks
    draft_free = draft.kv.allocator.num_free == draft.kv.num_blocks
    return target_free and draft_free and draft.num_tracked == 0


@pytest.fixture(scope="module")
def plain(folders: dict[str, Path]) -> list[Completion]:
    engine = our_engine(folders["target"], kv=POOL)
    assert engine.scheduler.drafter is None
    return engine.generate(prompts_of(engine), GREEDY)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_with_a_draft_model_equals_plain_decoding(
    folders: dict[str, Path], plain: list[Completion], k: int
) -> None:
    spec = drafting(folders, "draft", k)
    got = spec.generate(prompts_of(spec), GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [c.text for c in got] == [c.text for c in plain]
    assert spec.scheduler.acceptance.drafted > 0
    assert all_free(spec)


def test_the_target_drafting_for_itself_is_always_accepted(
    folders: dict[str, Path], plain: list[Completion]
) -> None:
    """Its drafts are its own greedy tokens: every one is kept, so the draft's KV after a
    verify step (rolled back to what was accepted, caught up on the rest) holds the
    right tokens at the right positions; then every block of both pools is free."""
    spec = drafting(folders, "target", 4)
    prompts = prompts_of(spec)
    ids = [spec.add_request(p, GREEDY) for p in prompts]
    draft = draft_of(spec)
    made: dict[int, list[int]] = {i: [] for i in ids}
    while spec.has_unfinished():
        for out in spec.step():
            made[out.seq_id] += out.token_ids
        for seq in spec.scheduler.running:  # positions: the draft holds seq's own prefix
            held = draft.cached_tokens(seq.seq_id)
            assert held == seq.token_ids[: len(held)]
    assert [made[i] for i in ids] == [c.token_ids for c in plain]
    counts = spec.scheduler.acceptance
    assert counts.drafted > 0 and counts.accepted == counts.drafted  # rate 1.0
    # The three sequences draft together: one pass of the draft per draft position.
    assert draft.counts.steps * 2 < counts.drafted
    assert all_free(spec)


@pytest.mark.parametrize(("draft", "k"), [("target", 4), ("draft", 3)])
def test_the_draft_models_own_counts_reach_the_workers_totals(
    folders: dict[str, Path], plain: list[Completion], draft: str, k: int
) -> None:
    """The draft model's passes, the drafts it handed out and those a verify step kept,
    in the totals a worker reports (reported_totals, read as it reports): drafting for
    itself every draft whose fate was seen was kept; a random draft's are nearly all
    rejected."""
    spec = drafting(folders, draft, k)
    assert [c.token_ids for c in spec.generate(prompts_of(spec), GREEDY)] == [
        c.token_ids for c in plain
    ]
    totals = reported_totals(spec.scheduler.acceptance, spec.scheduler.drafter)
    own = draft_of(spec).counts
    assert (totals.draft_steps, totals.draft_proposed) == (own.steps, own.proposed)
    assert totals.draft_accepted == own.accepted
    verified = spec.scheduler.acceptance
    assert own.steps > 0 and own.proposed >= verified.drafted > 0
    # A finished sequence's last drafts are handed out but never settled: at most k each.
    unseen = len(prompts_of(spec)) * k
    if draft == "target":
        assert verified.accepted - unseen <= own.accepted <= verified.accepted
    else:
        assert own.accepted <= verified.accepted and own.accepted / own.proposed < 0.2


def test_a_random_draft_is_almost_always_rejected_with_the_same_answers(
    folders: dict[str, Path], plain: list[Completion]
) -> None:
    spec = drafting(folders, "draft", 4)
    got = spec.generate(prompts_of(spec), GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    counts = spec.scheduler.acceptance
    assert counts.drafted >= 20 and counts.accepted / counts.drafted < 0.2
    assert all_free(spec)


def test_sampled_requests_verify_greedy_drafts_and_repeat_with_a_seed(
    folders: dict[str, Path],
) -> None:
    """Greedy drafts are a point mass for rejection sampling; seeded, the answer repeats."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    runs = []
    for _ in range(2):
        spec = drafting(folders, "target", 4)
        [done] = spec.generate(prompts_of(spec)[:1], params)
        assert spec.scheduler.acceptance.drafted > 0
        assert all_free(spec)
        runs.append(done.token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_a_handed_off_sequence_gets_the_drafts_own_prefill(
    folders: dict[str, Path], plain: list[Completion]
) -> None:
    """A decode pool's sequence arrives with the target's K/V only: the draft prefills
    its prompt at the first proposal (counted), and the answer is plain decoding's."""
    prefill = our_engine(folders["target"], kv=POOL)
    decode = drafting(folders, "target", 4)
    prompt = prompts_of(decode)[0]
    seq_id = prefill.add_request(prompt, GREEDY, prefill_only=True)
    first: list[int] = []
    blocks = None
    while blocks is None:
        for out in prefill.step():
            first += out.token_ids
            blocks = out.handoff_blocks
    pulled = decode.add_prefilled(prompt + first, len(prompt), GREEDY, prefill.kv_shards, blocks)
    assert pulled is not None
    prefill.release(seq_id)
    rest = []
    while decode.has_unfinished():
        rest += [t for out in decode.step() for t in out.token_ids]
    assert first + rest == plain[0].token_ids
    counts = draft_of(decode).counts
    assert counts.prefill_tokens == len(prompt) + 1  # the prompt and the first token
    assert decode.scheduler.acceptance.accepted == decode.scheduler.acceptance.drafted > 0
    assert all_free(decode)


def test_the_drafts_pool_comes_out_of_the_targets_budget(folders: dict[str, Path]) -> None:
    plain = our_engine(folders["target"], kv={"memory_mb": 4, "block_size": 4})
    spec = drafting(folders, "draft", 4, kv={"memory_mb": 4, "block_size": 4})
    draft = draft_of(spec)
    used = spec.kv.tensor.nbytes + draft.kv.tensor.nbytes
    assert used <= 4 * 2**20
    assert draft.kv.num_blocks == spec.kv.num_blocks < plain.kv.num_blocks
    # Two layers of 2 KV heads of 16 against one layer of 2 of 8: a fifth of the bytes.
    assert spec.kv.num_blocks == plain.kv.num_blocks * 4 // 5


def test_a_draft_on_a_device_of_its_own_takes_nothing_from_the_targets_pool(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """speculative.draft_device: the worker's own device (cpu here) is the default's
    split; another device gets the draft and a pool of as many blocks, the target keeps
    its whole pool, and the answers are the same; a device this process lacks is refused
    at start, naming the setting. A CPU has no second device: the other one is stood in
    for by cpu:0, which torch counts as another device (the real one, a second GPU:
    benchmarks/gpu_tests/test_draft_device.py)."""
    kv = {"memory_mb": 4, "block_size": 4}
    plain = our_engine(folders["target"], kv=kv)
    shared = drafting(folders, "draft", 4, kv=kv)

    def spec(device: str) -> dict[str, Any]:
        fields = {"method": "draft", "draft_model": folders["draft"], "adaptive": False}
        return fields | {"draft_device": device}

    named = our_engine(folders["target"], kv=kv, speculative=spec("cpu"))
    assert named.kv.num_blocks == shared.kv.num_blocks < plain.kv.num_blocks
    monkeypatch.setattr(draft_loading, "draft_device", lambda name, target: torch.device("cpu", 0))
    apart = our_engine(folders["target"], kv=kv, speculative=spec("cpu"))
    assert apart.kv.num_blocks == plain.kv.num_blocks == draft_of(apart).kv.num_blocks
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = prompts_of(plain)
    assert [c.token_ids for c in apart.generate(prompts, params)] == [
        c.token_ids for c in plain.generate(prompts, params)
    ]
    assert draft_of(apart).counts.proposed > 0 and all_free(apart)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"speculative\.draft_device is cuda:1, but torch sees"):
        our_engine(folders["target"], kv=kv, speculative=spec("cuda:1"))
    with pytest.raises(ValidationError, match="draft_device"):
        SpeculativeSettings(draft_device="gpu1")


def test_a_draft_of_another_vocabulary_is_refused_at_start(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cannot draft for") as refused:
        drafting(folders, "other_vocab", 4)
    message = str(refused.value)
    assert str(folders["other_vocab"]) in message and str(folders["target"]) in message
    assert "50000" in message and "49152" in message
    with pytest.raises(ValueError, match="tokenizer differs") as refused:
        drafting(folders, "swapped", 4)
    assert "'t' is id 101 in the draft, 100 in the target" in str(refused.value)


def test_a_prefill_worker_loads_no_draft(folders: dict[str, Path]) -> None:
    """Its sequences park after their first token: a draft would only take memory."""
    spec = {"method": "draft", "draft_model": folders["draft"]}
    kv = {"memory_mb": 4, "block_size": 4}
    settings = load_settings(
        model=folders["target"], dtype="float32", device="cpu", kv=kv, speculative=spec
    )
    prefill = LLMEngine.from_settings(settings, shared_kv=True, decodes=False)
    decode = LLMEngine.from_settings(settings)
    assert prefill.scheduler.drafter is None
    assert prefill.kv.num_blocks > decode.kv.num_blocks  # the whole budget is its own
    assert draft_of(decode).kv.num_blocks == decode.kv.num_blocks


def test_a_tiny_random_draft_for_the_real_smollm2(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine], folders: dict[str, Path]
) -> None:
    """The real target and tokenizer (the embedded GGUF, whose tokenizer is extracted
    from the file) with a random draft over the same vocabulary: the vocabularies are
    found one, and greedy output is plain decoding's."""
    settings = load_settings(dtype="float32", device="cpu")
    draft_files = load_model_files(folders["draft"], settings.cache_dir)
    check_vocabulary(draft_files, load_model_files(None, settings.cache_dir))
    model = build_draft(settings, draft_files, engine.model.device, 8192)
    cfg = model.config
    layout = KVLayout(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    draft = DraftModelProposer(model, KVCache(layout, 256, model.device))
    spec = make_engine(block_size=4)
    spec.scheduler.drafter = Drafter(draft, 4)
    prompts = prompts_of(engine)
    expected = engine.generate(prompts, GREEDY)
    got = spec.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert spec.scheduler.acceptance.drafted > 0
    assert spec.num_free_blocks == spec.kv.num_blocks
    assert draft.kv.allocator.num_free == 256 and draft.num_tracked == 0


def test_a_quantized_gguf_draft_for_a_float_gguf_target(tmp_path: Path) -> None:
    """Any format we load: the target a float32 GGUF, the draft the same model's Q8_0
    GGUF (its matrices multiplied in their blocks), both over the toy tokenizer the
    GGUFs carry: the same answers, most drafts kept, every block free after."""
    config = tiny_config("LlamaConfig", len(TOY_TOKENS), tie_word_embeddings=True)
    model = random_model(config)
    meta = tiny_gguf_metadata(config)
    target = write_gguf(model, tmp_path / "tiny-F32.gguf", gguf.MODEL_ARCH.LLAMA, meta)
    draft = write_gguf(
        model, tmp_path / "tiny-Q8_0.gguf", gguf.MODEL_ARCH.LLAMA, meta, quantize=True
    )
    kv = {"num_blocks": 128, "block_size": 4}
    plain = our_engine(target, kv=kv)
    spec_settings = {"method": "draft", "draft_model": draft, "adaptive": False}
    spec = our_engine(target, kv=kv, speculative=spec_settings, weights="auto")
    proposer = draft_of(spec)
    # The draft multiplies its Q8_0 blocks in place (the target has none).
    assert any(isinstance(m, QuantLinear) for m in proposer.model.modules())
    assert not any(isinstance(m, QuantLinear) for m in spec.model.modules())
    prompts = [plain.tokenizer.encode(text) for text in ("hello world, hello", "abc abc ab")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    counts = spec.scheduler.acceptance
    assert counts.drafted > 0 and counts.accepted / counts.drafted > 0.5
    assert all_free(spec)


def test_the_adaptive_rule_counts_the_drafts_own_step(folders: dict[str, Path]) -> None:
    """A draft token costs a draft step besides its verify row (the draft's share of the
    target's weight bytes): a draft as large as the target never pays, so its sequences
    stop drafting after a few verify steps although every draft is kept."""

    def adaptive(draft: str) -> LLMEngine:
        spec = {"method": "draft", "draft_model": folders[draft]}  # adaptive by default
        return our_engine(folders["target"], kv=POOL, speculative=spec)

    def cost(engine: LLMEngine) -> float:
        drafter = engine.scheduler.drafter
        assert drafter is not None and drafter.policy is not None
        return drafter.policy.verify_token_cost

    size = {n: (folders[n] / "model.safetensors").stat().st_size for n in ("draft", "target")}
    row = SpeculativeSettings().verify_token_cost  # a verify row's own cost, without a draft
    assert cost(adaptive("draft")) == pytest.approx(min(1.0, row + size["draft"] / size["target"]))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = prompts_of(adaptive("draft"))[:1]
    [plain] = our_engine(folders["target"], kv=POOL).generate(prompt, params)
    drafted = {}
    for name, spec in (("adaptive", adaptive("target")), ("fixed", drafting(folders, "target", 4))):
        [done] = spec.generate(prompt, params)
        assert done.token_ids == plain.token_ids
        counts = spec.scheduler.acceptance
        assert counts.accepted == counts.drafted > 0
        drafted[name] = counts.drafted
        assert all_free(spec)
    assert cost(adaptive("target")) == 1.0
    # Fixed: every step drafts 4 (50 drafts in 64 tokens). Adaptive: 4 verify steps of 4,
    # a pause of 8 steps, probes from k = 1 up (1, 2, 4, 4), a pause of 16 (29 drafts).
    assert drafted["adaptive"] < 0.7 * drafted["fixed"]


@dataclass
class Followers:
    """A tensor-parallel leader's followers as engine_drafter sees them: how many shards,
    and the block counts their pools were told to take (the real command's effect on a
    follower's pool: test_speculative_tp.py)."""

    size: int
    resized: list[int] = field(default_factory=list)

    def resize_kv(self, num_blocks: int) -> None:
        self.resized.append(num_blocks)


def test_a_tensor_parallel_leader_resizes_its_followers_and_weighs_a_shards_step(
    folders: dict[str, Path],
) -> None:
    """The leader's target pool shrinks for the draft's; its followers are told the new
    count. A shard reads half the target's weights a step while the whole draft runs in
    the leader: a draft token costs twice the share it costs beside one whole target."""
    spec = {"method": "draft", "draft_model": folders["draft"]}
    settings = load_settings(
        model=folders["target"], dtype="float32", device="cpu", kv=POOL, speculative=spec
    )
    size = {n: (folders[n] / "model.safetensors").stat().st_size for n in ("draft", "target")}
    group = Followers(2)
    parts, drafter = engine_drafter(settings, load_shard(settings), True, group)
    assert group.resized == [parts.kv.num_blocks]
    assert drafter is not None and drafter.policy is not None
    share = size["draft"] / size["target"]  # ~0.5: the vocabulary's rows dominate both
    sharded = drafter.policy.verify_token_cost
    row = settings.speculative.verify_token_cost  # a verify row's own cost, without a draft
    assert sharded == pytest.approx(min(1.0, row + 2 * share))  # a cost past 1 never pays
    _, alone = engine_drafter(settings, load_shard(settings), True)
    assert alone is not None and alone.policy is not None
    assert alone.policy.verify_token_cost == pytest.approx(row + share)
    assert alone.policy.verify_token_cost < sharded
