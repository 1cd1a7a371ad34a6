"""Speculative decoding with a draft model (speculative.method = "draft"), on tiny random
models over the embedded tokenizer's vocabulary: greedy output with the draft equals
plain decoding token for token; the target drafting for itself is accepted always and a
random draft almost never, and after either every KV block, the target's and the
draft's, is free; a handed-off sequence gets the draft's own prefill; the draft's pool
comes out of the target's budget; a draft of another vocabulary is refused at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from copying_prompt import copying_prompt
from family_configs import tiny_config
from random_models import our_engine, random_model, save_folder

from appliance.engine.llm_engine import Completion, LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.draft_model import DraftModelProposer

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
    return {name: save_folder(random_model(cfg), root / name) for name, cfg in made.items()}


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
    assert all_free(spec)


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


def test_a_draft_of_another_vocabulary_is_refused_at_start(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cannot draft for") as refused:
        drafting(folders, "other_vocab", 4)
    message = str(refused.value)
    assert str(folders["other_vocab"]) in message and str(folders["target"]) in message
    assert "50000" in message and "49152" in message
