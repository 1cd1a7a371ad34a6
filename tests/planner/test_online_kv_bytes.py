"""The online profile's KV bytes a token follow kv_cache_dtype (issue 38): the planner
sizes pools and handoffs by what the workers' pools hold."""

from __future__ import annotations

import pytest

from appliance.planner.online_profile import box_facts
from appliance.settings.config import load_settings
from appliance.topology.devices import Device, Link, Topology

# SmolLM2-135M (the embedded model): 30 layers, 3 KV heads of 64; K and V.
VALUES_A_TOKEN = 2 * 30 * 3 * 64
CPU_BOX = Topology((Device("cpu", 0, "cpu", 2**33, 2**33, cores=(0, 1)),), ((Link("none"),),))


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "value_bytes"),
    [
        ("auto", "auto", 4),  # float32 activations on the CPU's quantized path
        ("auto", "bfloat16", 2),
        ("bfloat16", "auto", 2),
        ("bfloat16", "float32", 4),
    ],
)
def test_the_kv_bytes_a_token_follow_the_pools_dtype(
    dtype: str, kv_cache_dtype: str, value_bytes: int
) -> None:
    settings = load_settings(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    facts = box_facts(settings, CPU_BOX)
    assert facts.kv_bytes_per_token == VALUES_A_TOKEN * value_bytes
    assert f"kv_cache_dtype {kv_cache_dtype}" in facts.assumptions[0]
