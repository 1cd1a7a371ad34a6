"""The draft model's settings, the share of the KV budget its pool takes, and the prefix
its KV keeps after a verify step: quick, no model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance.engine.speculative.draft_kv import split_pool
from appliance.engine.speculative.draft_model import common_prefix
from appliance.engine.speculative.proposer import Drafter
from appliance.settings.engine import SpeculativeSettings


def test_method_draft_needs_a_draft_model_that_exists(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"method=draft needs speculative\.draft_model"):
        SpeculativeSettings(method="draft")
    with pytest.raises(ValidationError, match="draft_model: no such file or folder"):
        SpeculativeSettings(method="draft", draft_model=tmp_path / "missing.gguf")
    # vLLM's speculative_config.model is taken as the same field.
    assert SpeculativeSettings(method="draft", model=str(tmp_path)).draft_model == tmp_path


def test_a_draft_drafter_needs_its_loaded_model(tmp_path: Path) -> None:
    settings = SpeculativeSettings(method="draft", draft_model=tmp_path)
    with pytest.raises(ValueError, match="no draft model was loaded"):
        Drafter.from_settings(settings)


def test_the_pools_split_the_targets_bytes_in_proportion_to_their_blocks() -> None:
    # A draft block a quarter of the target's: both get 4/5 of the target's old count.
    assert split_pool(1000, 400, 100) == 800
    assert 800 * (400 + 100) <= 1000 * 400
    # Weights loaded after a GPU share was measured come out of it first.
    assert split_pool(1000, 400, 100, taken_bytes=50_000) == 700
    with pytest.raises(ValueError, match=r"raise kv\.memory_mb"):
        split_pool(1, 400, 100)


def test_the_draft_keeps_the_prefix_the_sequence_still_has() -> None:
    cached = [5, 6, 7, 8, 9]  # the context and the draft's own tokens fed back
    assert common_prefix(cached, [5, 6, 7, 8, 9, 4], 5) == 5  # every draft accepted
    assert common_prefix(cached, [5, 6, 7, 3], 5) == 3  # rejected at the 4th
    assert common_prefix(cached, [5, 6, 7, 8, 9], 3) == 3  # only 3 were computed
    assert common_prefix(cached, [1, 6], 5) == 0
