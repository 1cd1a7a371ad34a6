"""What a stored KV block's bytes depend on besides its tokens: the namespace of its key.

Two workers may share a block only when they would compute the same bytes for it: the
same model and weights, KV dtype, block size, tensor-parallel shard of the heads, and
prefill kernel where the kernel changes the numbers. vLLM's per-request `cache_salt`
joins them so one tenant never reads another's prefixes (whose timing would tell what
the other sent). The digest is a fixed hash of every field, the same in every process.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DIGEST_BYTES = 16


@dataclass(frozen=True)
class StoreNamespace:
    """Everything besides the tokens that changes a block's K/V bytes."""

    model: str  # the model's identity: its name or path and revision
    weights: str  # the weights' identity: a file digest, the quantization
    kv_dtype: str  # the pool's element type by name ("bfloat16")
    block_size: int  # tokens per block
    shard_index: int = 0  # which tensor-parallel shard of the KV heads
    shard_count: int = 1
    prefill_kernel: str = ""  # the prefill GEMM where it changes numbers; "" where it does not
    cache_salt: str = ""  # vLLM's per-request salt: tenants never share blocks

    def __post_init__(self) -> None:
        if not self.model or not self.weights or not self.kv_dtype:
            raise ValueError(f"a store namespace names its model, weights and kv_dtype: {self}")
        if self.block_size < 1:
            raise ValueError(f"store namespace block_size must be >= 1, not {self.block_size}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"store namespace shard_index {self.shard_index} is outside "
                f"shard_count {self.shard_count}"
            )

    def digest(self) -> bytes:
        """16 bytes naming this namespace, stable across processes, runs and machines."""
        # Sorted JSON of the fields: a field added later changes every digest, as it must.
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=DIGEST_BYTES).digest()
