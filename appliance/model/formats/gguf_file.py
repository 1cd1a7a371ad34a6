"""Reading a GGUF file: architecture metadata, and weights dequantized to float32 a tensor
(or a piece of one) at a time. MXFP4 (gpt-oss's experts) is read so, dequantized by the
gguf package; only the formats in quant.FORMATS stay in their blocks.

Weights come back under Hugging Face names and layouts, so one model class serves
GGUF files and safetensors folders alike.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from appliance.model import registry
from appliance.model.errors import ModelLoadError
from appliance.model.formats import gguf_names
from appliance.model.formats.gguf_index import TensorEntry, tensor_index
from appliance.model.model_config import ModelConfig, check_sliding_window
from appliance.model.quant import FORMATS, BlockFormat, QuantWeight

SUPPORTED_QUANTS = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)


def open_gguf(path: Path, mode: Literal["r", "r+", "c"] = "r") -> GGUFReader:
    """Open a GGUF file or raise ModelLoadError saying why it is not one; mode "c" maps it
    copy-on-write (its tensors writable views, private only where written)."""
    check_size(path, tensor_index(path))  # before the reader: it fails on a short file obscurely
    try:
        return GGUFReader(path, mode)
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise ModelLoadError(path, f"not a valid GGUF file ({type(exc).__name__}: {exc})") from None


def check_size(path: Path, entries: Iterable[TensorEntry]) -> None:
    """ModelLoadError naming both sizes when the file is shorter than its tensor table
    says (an interrupted download or copy)."""
    size = path.stat().st_size
    needed = 0
    for entry in entries:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(entry.type_id)]
        except (ValueError, KeyError):  # an unknown type is refused where it is read
            continue
        needed = max(needed, entry.offset + math.prod(entry.dims) // block * block_bytes)
    if needed > size:
        raise ModelLoadError(
            path,
            f"the file is truncated: it has {size} bytes, its tensor table needs {needed}, so "
            "tensors run past the end (an interrupted download or copy? fetch it again)",
        )


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata fields as plain Python values (large arrays left out)."""
    out = {}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") or key.startswith("GGUF."):
            continue
        out[key] = fld.contents()
    return out


def read_model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """The architecture facts from the file's metadata: those every llama.cpp
    architecture writes alike, then what the family (registry.gguf_family) reads of its
    own."""
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    family = registry.gguf_family(arch, path)
    assert isinstance(arch, str)  # gguf_family() knows it

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(path, f"metadata key {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(
            path, f"metadata key {arch}.vocab_size is missing and the file has no token list"
        )
    config = ModelConfig(
        architecture=family.gguf[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(meta, arch),
        eos_token_ids=_stop_ids(reader),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=_sliding_window(meta.get(f"{arch}.attention.sliding_window"), arch, path),
        **_experts(meta, arch, tensor_names, path),
    )
    facts = getattr(family.module(), "gguf_facts", None)
    return config if facts is None else facts(config, meta, reader, path)


def _sliding_window(value: Any, arch: str, path: Path) -> int | None:
    """The file's `<arch>.attention.sliding_window` (a uint32 in GGUF), or None (also a
    phi3 file's 0, which llama.cpp writes for a model without a window)."""
    if value is None or (arch == "phi3" and int(value) == 0):
        return None
    return check_sliding_window(int(value), str(path))


def _stop_ids(reader: GGUFReader) -> tuple[int, ...]:
    """End of text, of turn and of message: a Llama 3.1 GGUF names all three, and its
    generation config (which the GGUF does not carry) stops on each."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    found = (reader.fields.get(f"tokenizer.ggml.{k}") for k in keys)
    return tuple(dict.fromkeys(int(f.contents()) for f in found if f is not None))


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    # llama3-style scaling arrives as a rope_freqs tensor, which the model applies itself.
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    return None


def _experts(meta: dict[str, Any], arch: Any, names: set[str], path: Path) -> dict[str, Any]:
    """A mixture-of-experts file's routed experts (llama.cpp's Mixtral is a "llama" with
    expert_count; "qwen3moe"): the layers with a router route, the others keep a dense
    MLP. Weights renormalized unless expert_weights_norm says not (llama.cpp always
    renormalizes Mixtral's and Qwen3-MoE's)."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    layers = int(meta[f"{arch}.block_count"])
    used = int(meta.get(f"{arch}.expert_used_count") or 0)
    if not 0 < used <= experts:
        raise ModelLoadError(path, f"{arch}.expert_used_count {used} of {experts} experts")
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta[f"{arch}.feed_forward_length"]
    if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in names):
        old = "experts stored one tensor each (an old Mixtral GGUF) are not supported"
        raise ModelLoadError(path, f"{old}; convert it again")
    return {
        "num_experts": experts,
        "experts_per_token": used,
        "expert_intermediate_size": int(width),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names
        ),
    }


def read_weights(path: Path, config: ModelConfig) -> GGUFWeights:
    """The file's tensors under their Hugging Face names and layouts, each read and
    dequantized to float32 only when asked for (GGUFWeights)."""
    return GGUFWeights(path, config)


# Float32 bytes of one piece of a tensor at most (GGUFWeights.pieces): small host pieces.
PIECE_BYTES = 16 * 2**20
_FLOAT_TYPES = frozenset(GGMLQuantizationType[n] for n in ("F32", "F16", "BF16"))
T = TypeVar("T")
R = TypeVar("R")


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by Hugging Face name, each read from the file (not mapped: no
    page of it stays in this process) and dequantized to float32, in Hugging Face layout,
    when asked for, and kept by nobody here: a load holds one tensor at a time, never a
    float32 copy of the model. Reading the index checks every tensor's name, quant type
    and extent, so a bad file fails before anything is read."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        self.path = path
        self.config = config
        size = path.stat().st_size
        self._entries: dict[str, TensorEntry] = {}
        entries = tensor_index(path)
        check_size(path, entries)
        for entry in entries:
            qtype = _supported_type(entry.name, entry.type_id, path)
            if entry.offset + _row_bytes(entry, qtype) * _rows(entry) > size:
                raise ModelLoadError(path, f"tensor {entry.name} runs past the end of the file")
            self._entries[gguf_names.hf_name(entry.name, path, config.architecture)] = entry

    def __getitem__(self, name: str) -> torch.Tensor:
        rows = _rows(self._entries[name])
        return torch.from_numpy(self._read(name, 0, rows)).view(self.shape(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor as float32 [rows, last dimension] (one expert's)."""
        return torch.from_numpy(self._read(name, start, stop))

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, slowest dimension first, read from the index alone."""
        return tuple(reversed(self._entries[name].dims))

    def block_quantized(self) -> bool:
        """Whether any tensor is in a block format (dequantizing it costs more than a read)."""
        types = {GGMLQuantizationType(e.type_id) for e in self._entries.values()}
        return not types <= _FLOAT_TYPES

    def pieces(
        self, names: Iterable[str], threads: int = 1, max_bytes: int = PIECE_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors `names`, in order, as float32 pieces [rows, last dimension] of about
        `max_bytes` at most (whole rows; whole heads of a Q/K projection, whose rows move
        within their heads), each with its tensor's name: small host pieces, dequantized
        by `threads` threads that run at most that many pieces ahead of the reader."""
        spans = [
            (name, start, stop) for name in names for start, stop in self._spans(name, max_bytes)
        ]
        for name, array in _in_order(lambda span: (span[0], self._read(*span)), spans, threads):
            yield name, torch.from_numpy(array)

    def _spans(self, name: str, max_bytes: int) -> list[tuple[int, int]]:
        """The row ranges of a tensor's pieces."""
        entry = self._entries[name]
        rows = _rows(entry)
        step = max(1, max_bytes // (4 * entry.dims[0]))
        heads = gguf_names.rope_heads(name, self.config)
        if heads:
            per_head = rows // heads
            step = max(1, step // per_head) * per_head
        return [(start, min(rows, start + step)) for start in range(0, rows, step)]

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of a tensor as float32 [rows, last dimension], llama Q/K rows in
        Hugging Face order."""
        entry = self._entries[name]
        qtype = GGMLQuantizationType(entry.type_id)
        row_bytes = _row_bytes(entry, qtype)
        raw = np.empty((stop - start, row_bytes), dtype=np.uint8)
        with self.path.open("rb") as file:
            file.seek(entry.offset + start * row_bytes)
            got = file.readinto(raw.data.cast("B"))
        if got != raw.nbytes:  # the file shrank since its index was read
            raise ModelLoadError(self.path, f"tensor {entry.name} runs past the end of the file")
        array = dequantize(raw, qtype).reshape(stop - start, entry.dims[0])
        heads = gguf_names.rope_heads(name, self.config)
        if heads:  # the span holds whole heads (_spans)
            array = gguf_names.unpermute_rope_rows(array, heads * (stop - start) // _rows(entry))
        if self.config.architecture == "gemma3" and name.endswith("norm.weight"):
            array = array - 1  # llama.cpp stores Gemma's norm weights as 1 + weight
        # F32 rows view `raw`, which nothing else holds: the array owns writable memory.
        return np.require(array, np.float32, ["C", "W"])


def _in_order(function: Callable[[T], R], items: list[T], threads: int) -> Iterator[R]:
    """function(item) for each item, in order, run by `threads` threads at most `threads`
    items ahead of the consumer (numpy and torch release the GIL in their loops)."""
    if threads <= 1:
        yield from map(function, items)
        return
    with ThreadPoolExecutor(threads) as pool:
        pending: deque[Future[R]] = deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _rows(entry: TensorEntry) -> int:
    """Rows of a tensor in PyTorch's layout: all but its fastest dimension."""
    return math.prod(entry.dims[1:])


def _row_bytes(entry: TensorEntry, qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return entry.dims[0] // block * size


def _supported_type(name: str, type_id: int, path: Path) -> GGMLQuantizationType:
    """The tensor's GGML type, or ModelLoadError naming it when we cannot dequantize it."""
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(path, f"tensor {name} has unknown GGML type {type_id}") from None
    if qtype not in SUPPORTED_QUANTS:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_QUANTS))
        raise ModelLoadError(
            path,
            f"tensor {name} has unsupported quant type {qtype.name} (supported: {supported})",
        )
    return qtype


def _quant_entries(path: Path) -> list[tuple[TensorEntry, BlockFormat]]:
    """The file's matrices in block formats (model/quant.py), with their formats: 2-D
    tensors, and stacked experts' 3-D ones (rows expert after expert)."""
    by_id = {fmt.ggml_id: fmt for fmt in FORMATS.values()}
    return [
        (entry, by_id[entry.type_id])
        for entry in tensor_index(path)
        if entry.type_id in by_id and (len(entry.dims) == 2 or "_exps." in entry.name)
    ]


def quant_names(path: Path, architecture: str = "llama") -> list[str]:
    """Hugging Face names of the file's 2-D weights in block formats (model/quant.py)."""
    return [gguf_names.hf_name(entry.name, path, architecture) for entry, _ in _quant_entries(path)]


def read_quant_weights(path: Path, config: ModelConfig) -> dict[str, QuantWeight]:
    """The file's weights in block formats (model/quant.py), kept in their blocks under
    their Hugging Face names, Q/K rows in Hugging Face order: views of the file mapped
    copy-on-write (Q/K rows reordered are copies), which the model copies once into its
    own memory (QuantWeight.owned, concat_rows), so a user rewriting the file cannot reach
    a running worker and no weight is held twice."""
    entries = _quant_entries(path)
    out: dict[str, QuantWeight] = {}
    if not entries:
        return out
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    for entry, fmt in entries:
        name = gguf_names.hf_name(entry.name, path, config.architecture)
        in_features, rows = entry.dims[0], _rows(entry)  # fastest first
        if in_features % fmt.values:
            raise ModelLoadError(path, f"tensor {entry.name} rows are not whole blocks")
        row_bytes = in_features // fmt.values * fmt.bytes
        if entry.offset + rows * row_bytes > len(mapped):
            raise ModelLoadError(path, f"tensor {entry.name} runs past the end of the file")
        blocks = mapped[entry.offset : entry.offset + rows * row_bytes].reshape(rows, row_bytes)
        heads = gguf_names.rope_heads(name, config)
        if heads:
            blocks = gguf_names.unpermute_rope_rows(blocks, heads)  # whole rows move: blocks stay
        out[name] = QuantWeight(fmt, torch.from_numpy(np.asarray(blocks)), in_features)
    return out


def dequantize_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One tensor of a GGUFReader as float32 in row-major (PyTorch) shape."""
    qtype = _supported_type(tensor.name, int(tensor.tensor_type), path)
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, qtype).astype(np.float32, copy=False).reshape(shape)
