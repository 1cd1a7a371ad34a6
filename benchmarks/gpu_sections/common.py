"""What every section shares: the checkout's root, a section's result (`verdict`), random
prompts, the appliance's settings for an in-process engine of a scale, markdown tables."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .scale import Scale

if TYPE_CHECKING:
    from appliance.settings.config import Settings


Result = dict[str, Any]


ROOT = Path(__file__).resolve().parents[2]


def verdict(checks: dict[str, bool], **details: Any) -> Result:
    """A section's result: pass when every named check holds, with what it measured."""
    failed = [name for name, ok in checks.items() if not ok]
    status = "fail" if failed else "pass"
    return {"status": status, "checks": checks, "failed": failed, **details}


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    """A prompt of `length` token ids, clear of the special tokens at the vocabulary's ends."""
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def settings_for(scale: Scale, dtype: str, **overrides: Any) -> Settings:
    """The appliance's settings for an in-process engine of this scale (its device)."""
    from appliance.settings.config import load_settings

    # Dense weights: the sections using these check the dense bfloat16 path (a safetensors
    # model's on a GPU); a GGUF's blocks kept on the GPU are quant_decode's to check.
    return load_settings(
        model=scale.model, dtype=dtype, device=scale.device.type, weights="dense", **overrides
    )


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows of equal keys as a markdown table (the lines)."""
    if not rows:
        return []
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys)]
    return lines + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
