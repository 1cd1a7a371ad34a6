"""Loading weights a tensor at a time: what the model ends with, and what the host holds.

CausalLM.load_weights copies each source tensor into its parameter (q/k/v and gate/up
into their rows of the fused one) as it is read, so no full-size float copy of the model
is ever made; a GGUF's dense cache is written in small pieces. The memory tests load in
a fresh process and compare its peak resident set (VmHWM, file pages it mapped
included) over its peak after the imports with the size of the weights it ends with.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf_builder
import numpy as np
import pytest
import torch
from gguf_builder import model_tensors
from tests_root import ROOT

from appliance.model.errors import ModelLoadError
from appliance.model.families.llama import LlamaForCausalLM as CausalLM
from appliance.model.formats import gguf_file
from appliance.model.model_config import ModelConfig
from appliance.model.model_source import default_model_path
from appliance.model.tensor_parallel import WHOLE_MODEL, Shard, shard_state

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

CPU = torch.device("cpu")
MiB = 2**20


# --- what loading makes ---------------------------------------------------------------------


class Tracked(Mapping[str, torch.Tensor]):
    """Weights handed out as fresh tensors, counting how many are alive at once and which
    were released (the protocol safetensors_file.MappedTensors follows)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self.alive = 0
        self.most_alive = 0
        self.released: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._weights[name].clone()
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(tensor, self._gone)
        return tensor

    def _gone(self) -> None:
        self.alive -= 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def release(self, name: str) -> None:
        self.released.append(name)


def tiny_model(tmp_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The builder's two-layer llama, read back under Hugging Face names."""
    path = gguf_builder.write_gguf(tmp_path / "m.gguf", model_tensors(np.random.default_rng(3)))
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    return config, dict(gguf_file.read_weights(path, config).items())


def fused_reference(
    weights: dict[str, torch.Tensor], config: ModelConfig, shard: Shard
) -> dict[str, torch.Tensor]:
    """The parameters as the model used to make them: the shard's whole weights cut, then
    q/k/v and gate/up concatenated."""
    cut = {k.removeprefix("model."): v for k, v in shard_state(weights, config, shard).items()}
    out = {}
    for name, tensor in cut.items():
        if ".q_proj." in name:
            parts = [cut[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".gate_proj." in name:
            up = cut[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([tensor, up])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = tensor
    return out


def meta_model(config: ModelConfig, dtype: torch.dtype, shard: Shard = WHOLE_MODEL) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config, dtype, CPU, 64, shard)


@pytest.mark.parametrize("shard", [Shard(0, 1), Shard(0, 2), Shard(1, 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_tensor_goes_into_its_parameter_one_at_a_time(tmp_path, shard, dtype):
    config, weights = tiny_model(tmp_path)
    model = meta_model(config, dtype, shard)
    tracked = Tracked(weights)
    model.load_weights(tracked, "test")
    assert tracked.most_alive == 1  # never two source tensors at once
    assert sorted(tracked.released) == sorted(weights)  # each given back once copied
    expected = fused_reference(weights, config, shard)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(expected)
    for name, param in params.items():
        assert param.device == CPU and param.dtype == dtype and not param.requires_grad, name
        torch.testing.assert_close(param, expected[name].to(dtype), rtol=0, atol=0, msg=name)


def test_a_missing_part_of_a_fused_projection_is_named(tmp_path):
    config, weights = tiny_model(tmp_path)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing \['model.layers.1.self_attn.v_proj"):
        meta_model(config, torch.float32).load_weights(weights, "m.gguf")


def test_an_unexpected_weight_is_named(tmp_path):
    config, weights = tiny_model(tmp_path)
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    with pytest.raises(ModelLoadError, match=r"unexpected \['model.layers.0.mlp.extra.weight"):
        meta_model(config, torch.float32).load_weights(weights, "m.gguf")


def test_a_part_of_the_wrong_shape_is_named(tmp_path):
    config, weights = tiny_model(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name][:-1]
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(127, 64\)"):
        meta_model(config, torch.float32).load_weights(weights, "m.gguf")


# --- peak host memory -------------------------------------------------------------------------

# One load in a fresh process: the first start of a dense model of `dtype` from a GGUF
# (its cache written into an empty entry, then loaded), by build_model for float32 and
# CausalLM.load_weights for bfloat16 (build_model then packs bfloat16 linears where oneDNN
# can, which makes copies of its own: not loading's).
CHILD = r"""
import json, math, sys
from pathlib import Path

import torch

from appliance.engine.shard_loading import build_model
from appliance.model.formats.gguf_file import read_weights
from appliance.model.families.llama import LlamaForCausalLM as CausalLM
from appliance.model.loader import ModelFiles
from appliance.model.model_config import ModelConfig


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


def peak():
    return status("VmHWM:")


def resident():
    return status("VmRSS:")


path, entry, dtype = Path(sys.argv[1]), Path(sys.argv[2]), getattr(torch, sys.argv[3])
config = ModelConfig.from_dict(json.loads(sys.argv[4]))
files = ModelFiles(path, config, read_weights(path, config), entry, entry)
largest = max(math.prod(files.weights.shape(n)) for n in files.weights) * 4
base = peak()
files.dense_weights(dtype)
written, left = peak(), resident()
if dtype == torch.float32:
    model = build_model(files, dtype, torch.device("cpu"), 64)
else:
    with torch.device("meta"):
        model = CausalLM(config, dtype, torch.device("cpu"), 64)
    model.load_weights(files.dense_weights(dtype), str(path))
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"base": base, "written": written, "left": left, "peak": peak(),
                  "weights": size, "largest": largest}))
"""


def load_in_a_fresh_process(path: Path, entry: Path, dtype: str) -> dict[str, Any]:
    entry.mkdir()
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    args = [str(path), str(entry), dtype, json.dumps(config.to_dict())]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_module() -> ModuleType:
    path = ROOT / "benchmarks/load_memory_bench.py"
    spec = importlib.util.spec_from_file_location("load_memory_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def assert_bounded(r: dict[str, Any], weights_mib: tuple[int, int]) -> None:
    """Writing the cache holds a few pieces of a tensor per thread, and leaves a few in
    the threads' heap; loading then holds the weights and one source tensor (the
    largest, as float32) beside them."""
    low, high = weights_mib
    assert low * MiB < r["weights"] < high * MiB, r  # the model is the size it should be
    writing, left = r["written"] - r["base"], r["left"] - r["base"]
    assert writing < 320 * MiB, f"writing the cache took {writing / MiB:.0f} MiB"
    assert left < 160 * MiB, f"writing the cache left {left / MiB:.0f} MiB behind"
    loading = r["peak"] - r["base"]
    bound = max(left, 0) + r["weights"] + r["largest"] + 64 * MiB
    assert loading < bound, (
        f"loading {r['weights'] / MiB:.0f} MiB of weights took {loading / MiB:.0f} MiB "
        f"(bound {bound / MiB:.0f} MiB)"
    )


@pytest.mark.parametrize(
    ("dtype", "weights_mib"), [("float32", (500, 530)), ("bfloat16", (250, 270))]
)
def test_the_default_model_loads_in_its_weights_and_one_tensor(tmp_path, dtype, weights_mib):
    """SmolLM2-135M (Q4_1/Q8_0, 94 MB) dense: 513 MiB as float32, where the old load (a
    float32 copy of every fused projection beside the mapped float32 cache) peaked at
    2.5 times that."""
    r = load_in_a_fresh_process(default_model_path(), tmp_path / "entry", dtype)
    assert_bounded(r, weights_mib)


def test_a_random_model_of_400_mb_loads_in_its_weights_and_one_tensor(tmp_path):
    bench = bench_module()
    shape = bench.Shape(hidden=1024, layers=6, heads=8, kv_heads=2, ff=2816, vocab=16000)
    path = bench.write_random_gguf(tmp_path / "random.gguf", shape)
    r = load_in_a_fresh_process(path, tmp_path / "entry", "float32")
    assert r["weights"] == 4 * shape.parameters()
    assert_bounded(r, (380, 420))
    assert math.isclose(r["largest"], 4 * shape.vocab * shape.hidden)
