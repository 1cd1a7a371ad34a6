"""A worker's side of the box's KV store (issue 41): its blocks go in, a prompt's stored
prefix comes out into its pool.

The supervisor owns the store (appliance/pools/kv_store_owner.py). Writing: the worker's
prefix cache tells of a cached block about to be reused (write_policy evict) or left
unused by its last request (finish); its bytes are copied out of the pool at once (they
are about to be overwritten), straight into an arena slot the supervisor reserved for
this worker (StoreSlots), and the next report says which block each slot holds
(StoreWritten); only with no reserved slot left do the bytes travel in the report
(StorePut). Under evict, an idle worker also writes the cached blocks its pool would
evict next (`clean_ahead`), so the prompt that needs their room finds them stored and
copies nothing out before its prefill. Reading: before a
prompt's Submit the supervisor sends StoreHits, the arena slots holding the prompt's
first blocks (and the partial block after them, a finished request's tail, where
stored), pinned for this worker; at the Submit the worker copies those its own pool
lacks straight from shared memory into free blocks, caches them as if computed, and
answers StoreRelease, so the prefill computes only the rest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.roles import Role
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.cuda_copies import CudaBlockCopies
from appliance.kv_store.host_arena import HostArena
from appliance.kv_store.namespace import StoreNamespace
from appliance.kv_store.pool_blocks import block_bytes, load_block, store_block
from appliance.settings.config import Settings
from appliance.workers.messages import (
    StoreHits,
    StorePut,
    StoreReady,
    StoreRelease,
    StoreSlots,
    StoreWritten,
)
from appliance.workers.outboxes import Outbox

HEAD_BYTES = 1 << 20  # how much of a weights file its identity digests
HANDED_KEPT = 65536  # handed-off prompt block keys a decode worker remembers
CLEAN_AHEAD = 32  # cached blocks next in line for eviction an idle worker keeps stored
# Blocks written ahead between two looks at the inbox: a prompt that comes meanwhile waits
# for at most this many copies (0.5-1.8 ms each in float32 on the bench's EPYC), not 32.
CLEAN_SLICE = 4


@dataclass
class StoreClient:
    """What one worker sends to and reads from the box's store."""

    worker_id: int
    engine: LLMEngine
    namespace: StoreNamespace
    evict_policy: bool = True  # False: blocks go in when their last request lets go
    digest: bytes = b""
    puts: list[tuple[int, bytes]] = field(default_factory=list)  # waiting for the report
    released: list[tuple[int, int]] = field(default_factory=list)  # (request, blocks loaded)
    pending: dict[int, StoreHits] = field(default_factory=dict)  # request id -> its hits
    in_store: set[int] = field(default_factory=set)  # keys of pool blocks the store has
    arena: HostArena | None = None
    block_nbytes: int = 0  # one block's bytes, as stored
    slots: list[int] = field(default_factory=list)  # arena slots reserved for our blocks
    written: list[tuple[int, int]] = field(default_factory=list)  # (key, slot) to commit
    # keys of blocks the pool evicted uncopied (the store held them): to be made recent
    refreshed: list[int] = field(default_factory=list)
    piped_blocks: int = 0  # blocks sent as bytes (no reserved slot left), since start
    may_clean: bool = True  # False: the blocks next in line are stored (clean_ahead)
    cuda: CudaBlockCopies | None = None  # a GPU pool's pinned staging and side stream
    loaded_blocks: int = 0  # since start
    decodes_handoffs: bool = False  # a decode worker: its prompts were prefilled elsewhere
    # keys of prompt blocks handed off to this decode worker: the prefill side has them
    handed: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.digest = self.namespace.digest()
        self.block_nbytes = block_bytes(self.engine.kv.tensor, 0).numel()
        self.cuda = CudaBlockCopies.for_pool(self.engine.kv.tensor)
        cache = self.engine.scheduler.blocks
        if self.evict_policy:
            cache.on_evict = self._on_evict
            if self.decodes_handoffs:
                # The blocks it decoded (a chat's answer) reach no prefill worker's pool:
                # stored as their request lets go, the next turn finds them there.
                cache.on_idle = self._on_idle_decoded
            else:
                cache.on_idle = self._on_idle_unstored
        else:
            cache.on_idle = self._on_idle
            cache.on_evict = self._on_evict_stored

    @classmethod
    def start(
        cls, worker_id: int, engine: LLMEngine, settings: Settings, outbox: Outbox, role: Role
    ) -> StoreClient:
        """This worker's client, announced to the supervisor (StoreReady)."""
        namespace = worker_namespace(engine, settings)
        evict = settings.kv_store.write_policy == "evict"
        client = cls(worker_id, engine, namespace, evict, decodes_handoffs=role == "decode")
        outbox.put(StoreReady(worker_id, namespace, client.block_nbytes))
        return client

    def take_slots(self, message: StoreSlots) -> None:
        """Arena slots the supervisor reserved for this worker's blocks."""
        self._attach(message.arena)
        self.slots += message.slots
        self.may_clean = True

    # ------------------------------------------------------------ writing

    def _on_evict(self, block: int, key: int) -> None:
        if key not in self.in_store:  # (a block loaded from the store is there already)
            self._copy_out(block, key)
        else:  # stored when written ahead or loaded, hot in the pool since: tell the store
            self.refreshed.append(key)
        self.in_store.discard(key)
        self.handed.pop(key, None)

    def _on_evict_stored(self, _block: int, key: int) -> None:
        """Under write_policy finish: stored as its last request let go, or loaded; its
        eviction makes it as recent in the store as it was in the pool."""
        if key in self.in_store:
            self.refreshed.append(key)
            self.in_store.discard(key)

    def _on_idle_decoded(self, block: int, key: int) -> None:
        if key not in self.in_store and key not in self.handed:
            self._copy_out(block, key)
            self.in_store.add(key)
        self.may_clean = True

    def _on_idle_unstored(self, _block: int, _key: int) -> None:
        self.may_clean = True  # a block joined the pool's cached ones: clean_ahead looks

    @property
    def cleaning(self) -> bool:
        """Whether clean_ahead may have blocks left to write (the worker then looks at its
        inbox without blocking, and writes the next slice)."""
        return self.evict_policy and self.may_clean and bool(self.slots)

    def clean_ahead(
        self, outbox: Outbox, depth: int = CLEAN_AHEAD, budget: int = CLEAN_SLICE
    ) -> int:
        """The worker is idle: write the `depth` cached blocks its pool evicts next (the
        least recently used) into reserved slots now, so a prompt that needs their room
        later evicts them with no copy before its prefill. At most `budget` a call (the
        worker's loop calls again after a look at its inbox, while `cleaning`), so a
        prompt arriving meanwhile waits for a few copies, not `depth`. Only into reserved
        slots (never piped); returns how many were written, and sends them."""
        if not self.cleaning:
            return 0
        written = 0
        for block, key in self.engine.scheduler.blocks.cached_blocks()[:depth]:
            if not self.slots or written == budget:
                break  # the rest at the next call (or once the slots are topped up)
            if key not in self.in_store and key not in self.handed:  # (handed: prefill's)
                self._copy_out(block, key)
                self.in_store.add(key)
                written += 1
        else:
            self.may_clean = False  # every block next in line is stored
        self.send(outbox)
        return written

    def handed_off(self, prompt: list[int], salt: str) -> None:
        """A prefilled prompt came to this decode worker: its full blocks are the prefill
        side's (in its pool, or stored on its eviction), not written again at finish."""
        for key in prefix_keys(prompt, self.engine.kv.block_size, salt):
            self.handed[key] = None
            self.handed.move_to_end(key)
        while len(self.handed) > HANDED_KEPT:
            self.handed.popitem(last=False)

    def _on_idle(self, block: int, key: int) -> None:
        if key not in self.in_store:
            self._copy_out(block, key)
            self.in_store.add(key)

    def _copy_out(self, block: int, key: int) -> None:
        """Block `block`'s bytes into a reserved arena slot (sealed: named once whole),
        else into the next report."""
        if self.slots and self.arena is not None:
            slot = self.slots.pop()
            try:
                self._write_slot(self.arena, slot, block, key)
            except BaseException:
                # Not sealed as whole: still ours to fill (else lost until the worker exits).
                self.slots.append(slot)
                raise
            self.written.append((key, slot))
            return
        data = block_bytes(self.engine.kv.tensor, block)  # [block's bytes] on its device
        self.puts.append((key, data.cpu().numpy().tobytes()))
        self.piped_blocks += 1

    def _write_slot(self, arena: HostArena, slot: int, block: int, key: int) -> None:
        """Block `block`'s bytes into reserved slot `slot`, then sealed as block `key`."""
        view = arena.payload(slot, self.block_nbytes)
        try:
            if self.cuda is not None:
                self.cuda.store(block, view)
            else:
                store_block(self.engine.kv.tensor, block, view)
        finally:
            view.release()
        arena.seal(slot, (self.digest, key), self.block_nbytes)

    def stop(self, outbox: Outbox) -> None:
        """The worker stops: its pool goes, so under write_policy evict every cached
        block is evicted now (a planned restart keeps them in the store)."""
        if self.evict_policy:
            for block, key in self.engine.scheduler.blocks.cached_blocks():
                self._on_evict(block, key)
        self.send(outbox)

    def send(self, outbox: Outbox) -> None:
        """What waits for the supervisor: blocks to store, hits copied."""
        if self.written or self.refreshed:
            outbox.put(StoreWritten(self.worker_id, self.digest, self.written, self.refreshed))
            self.written, self.refreshed = [], []
        if self.puts:
            outbox.put(StorePut(self.worker_id, self.digest, self.puts))
            self.puts = []
        if self.released:
            requests, loaded = zip(*self.released, strict=True)
            outbox.put(StoreRelease(self.worker_id, list(requests), list(loaded)))
            self.released = []

    # ------------------------------------------------------------ reading

    def hold(self, hits: StoreHits) -> None:
        """The store's hits for a prompt whose Submit comes next."""
        self.pending[hits.request_id] = hits

    def load(self, request_id: int, token_ids: list[int], params: SamplingParams) -> int:
        """Copy the stored blocks of this prompt's prefix that the pool lacks into it (the
        sequence then matches them as cached); returns how many."""
        hits = self.pending.pop(request_id, None)
        if hits is None:
            return 0
        if params.whole_prompt:
            self.released.append((request_id, 0))
            return 0  # every prompt position is computed (its logits, its hidden state)
        self._attach(hits.arena)
        found = list(zip(hits.block_keys, hits.slots, strict=True))
        size = self.engine.kv.block_size
        partial = None
        if hits.partial is not None:  # a finished request's tail: (position, n, its bytes)
            at, n, key, slot = hits.partial
            partial = (at, n, (key, slot))
        loaded = self.engine.scheduler.blocks.load_prefix(
            token_ids,
            (len(token_ids) - 1) // size,
            found,
            self._loader(hits.namespace),
            params.cache_salt,
            hits.positions,
            partial,
        )
        if self.cuda is not None:
            self.cuda.fence()  # the prefill's kernels wait for the loads on the GPU
        self.loaded_blocks += loaded
        self.released.append((request_id, loaded))
        return loaded

    def _attach(self, path: str) -> None:
        if self.arena is None or str(self.arena.path) != path:
            self.arena = HostArena.attach(Path(path))

    def _loader(self, namespace: bytes) -> Callable[[int, tuple[int, int]], bool]:
        arena = self.arena
        assert arena is not None

        def load(block: int, hit: tuple[int, int]) -> bool:
            key, slot = hit
            view = arena.read(slot, (namespace, key))
            if view is None:  # the slot no longer holds it: the prefix ends here
                return False
            try:
                if self.cuda is not None:
                    self.cuda.load(block, view)  # the bytes read now, the copy up in flight
                else:
                    load_block(self.engine.kv.tensor, block, view)
            finally:
                view.release()
            self.in_store.add(key)
            return True

        return load


def worker_namespace(engine: LLMEngine, settings: Settings) -> StoreNamespace:
    """Everything besides the tokens that changes this worker's blocks' bytes."""
    gemm = engine.model.prefill_gemm  # the quantized path's prompt GEMM changes numbers
    kernel = "" if gemm is None else f"{gemm.dtype}/{gemm.rows}"
    dtype = str(engine.kv.tensor.dtype).removeprefix("torch.")
    activations = str(engine.model.dtype).removeprefix("torch.")
    model = f"{settings.model or 'embedded'}@{settings.revision or ''}/{activations}"
    weights = f"{weights_identity(engine.model_source)}/{settings.weights}/{settings.quantize}"
    # One shard: a tensor-parallel worker's other shards' pools are in other processes,
    # which the store does not reach yet (worker.py starts no client for them).
    return StoreNamespace(model, weights, dtype, engine.kv.block_size, prefill_kernel=kernel)


def weights_identity(source: Path | None) -> str:
    """The weights' files by size and a digest of each one's head (a GGUF's header and
    first tensors; a safetensors file's header): another file reads as another model."""
    if source is None:
        return "unknown"
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}:".encode())
        with path.open("rb") as f:
            digest.update(f.read(HEAD_BYTES))
    return digest.hexdigest()
