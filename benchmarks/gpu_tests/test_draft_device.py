"""speculative.draft_device on a GPU machine (benchmarks/gpu_check.py, section
"cuda_tests"): the target on the GPU, its draft on a device of its own, only token ids
crossing between them. One GPU suffices: the draft's own device is the host's CPU (on a
box with a spare GPU it is that GPU, by the same path). Not in the CPU suite: a CPU has
no second device to put a draft on.

    .venv/bin/python -m pytest -q benchmarks/gpu_tests/test_draft_device.py
"""

from __future__ import annotations

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.draft_model import DraftModelProposer
from appliance.model.model_source import default_model_path
from appliance.settings.config import load_settings

if not torch.cuda.is_available():
    pytest.fail("these checks need a CUDA device", pytrace=False)

COMMON = {"device": "cuda", "dtype": "bfloat16", "weights": "dense", "kv": {"memory_mb": 512}}


def test_a_draft_on_its_own_device_gives_the_targets_tokens() -> None:
    """SmolLM2 drafting for itself from the CPU: every draft accepted, the answers plain
    decoding gives, the target's pool whole (nothing carved out for the draft)."""
    spec = {
        "method": "draft",
        "draft_model": default_model_path(),
        "draft_device": "cpu",
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    plain = LLMEngine.from_settings(load_settings(**COMMON))
    drafting = LLMEngine.from_settings(load_settings(**COMMON, speculative=spec))
    drafter = drafting.scheduler.drafter
    assert drafter is not None and isinstance(drafter.proposer, DraftModelProposer)
    draft = drafter.proposer
    assert draft.model.device.type == "cpu" and draft.kv.tensor.device.type == "cpu"
    assert drafting.kv.num_blocks == plain.kv.num_blocks == draft.kv.num_blocks
    text = "Speculative decoding drafts a few tokens and verifies them in one pass. " * 3
    prompts = [drafting.tokenizer.encode(text)[:n] for n in (7, 19, 40)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in drafting.generate(prompts, params)] == expected
    counts = drafting.scheduler.acceptance
    assert counts.drafted > 0 and counts.accepted > 0.8 * counts.drafted
