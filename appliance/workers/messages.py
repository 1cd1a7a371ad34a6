"""Messages between the supervisor and its workers: dataclasses on multiprocessing queues.

Supervisor -> worker (each worker's inbox) and worker -> supervisor (one shared outbox).
Request ids are the supervisor's; each worker maps them to its engine's own ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.engine.step_timing import StepTiming
from appliance.kv_store.namespace import StoreNamespace

if TYPE_CHECKING:  # a pool on another box: its module loads torch, the messages need not
    from appliance.kv.remote_pool import RemotePool

# ---------------------------------------------------------------- supervisor -> worker


@dataclass
class Submit:
    """Prefill (and, unless prefill_only, decode) a tokenized prompt."""

    request_id: int
    token_ids: list[int]
    params: SamplingParams
    prefill_only: bool
    trace: str = ""  # the supervisor's span as a W3C traceparent; "": not traced


@dataclass
class Handoff:
    """Continue a request whose prompt K/V sits in prefill worker `source`'s blocks."""

    request_id: int
    token_ids: list[int]  # prompt + first token
    num_prompt_tokens: int
    params: SamplingParams
    source: int
    blocks: list[int]
    trace: str = ""  # the supervisor's span as a W3C traceparent; "": not traced


@dataclass
class SharePool:
    """To a prefill worker: share your KV tensor with decode worker `consumer`; `remote`:
    it is on another box, and reads the pool through the transfer agent (RemotePool)."""

    consumer: int
    remote: bool = False


@dataclass
class PeerPool:
    """To a decode worker: prefill worker `worker_id`'s KV tensors, one per tensor-parallel
    shard as (first KV head, pickled tensor), each pickled by the shard's own process for
    this worker (a shared-memory fd or a CUDA IPC handle); from another box, the pools as
    its transfer agent registered them. The supervisor relays the bytes without opening
    them: a CUDA tensor a process received cannot be sent on."""

    worker_id: int
    data: list[tuple[int, bytes]] | list[RemotePool]


@dataclass
class DropPeer:
    """That prefill worker is about to stop: let go of its KV tensor, then say PeerDropped."""

    worker_id: int


@dataclass
class Tune:
    """New scheduler limits, applied from the next step (None keeps a limit)."""

    max_num_batched_tokens: int | None = None
    chunk_size: int | None = None
    max_num_seqs: int | None = None

    def changes(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class Release:
    """The decode side copied these blocks: the prefill worker frees them."""

    request_id: int


@dataclass
class Abort:
    request_id: int


@dataclass
class Shutdown:
    pass


# ---------------------------------------------------------------- worker -> supervisor


@dataclass
class Ready:
    """The worker loaded its model."""

    worker_id: int
    num_blocks: int
    shard_pids: list[int] = field(default_factory=list)  # its other shards' processes


@dataclass
class PoolShared:
    """A prefill worker's KV tensors pickled for decode worker `consumer` (see PeerPool)."""

    worker_id: int
    consumer: int
    data: list[tuple[int, bytes]] | list[RemotePool]


@dataclass
class PeerDropped:
    """A decode worker no longer holds prefill worker `peer`'s KV tensor."""

    worker_id: int
    peer: int


@dataclass
class TokenBatch:
    """Everything one model step produced, plus the worker's load after it."""

    worker_id: int
    outputs: list[Output] = field(default_factory=list)
    num_free_blocks: int = 0
    num_running: int = 0
    started: list[int] = field(default_factory=list)  # requests whose first chunk ran
    step_started_at: float = 0.0  # time.monotonic() (system-wide) when the step began
    timing: StepTiming | None = None  # the step's shape and seconds (None: not timed)
    # Its speculative decoding totals since it started: drafts verified and kept.
    speculation: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    # Prompt tokens its prefix cache served from partial blocks (a finished request's
    # last block, copied in) since it started: PrefixCache.partial_tokens.
    partial_tokens: int = 0


@dataclass
class Output:
    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    handoff_blocks: list[int] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output, where asked
    embedding: list[float] | None = None  # on the first output, where asked (params.embed)


@dataclass
class HandoffResult:
    """Whether a decode worker took a handed-off request (False: no room, try again)."""

    worker_id: int
    request_id: int
    accepted: bool
    bytes_moved: int = 0


@dataclass
class LeaseExpired:
    """A parked prefill's blocks were freed: no decode worker pulled them in time."""

    worker_id: int
    request_id: int


@dataclass
class Failed:
    """A request the worker could not take (bad input): it ends with this error."""

    worker_id: int
    request_id: int
    error: str


# ---------------------------------------------------------------- the box's KV store (issue 41)


@dataclass
class StoreHits:
    """Supervisor -> worker, just before the Submit of `request_id`: the blocks of its
    prompt that the box's KV store holds in shared memory (the arena file `arena`): the
    prompt's block `positions[j]`, keyed `block_keys[j]` in `namespace`, is in slot
    `slots[j]`. Pinned for this worker until it answers StoreRelease. The positions may
    have gaps (blocks the store lacks): the worker uses a block only where its own pool
    holds every block before it that the store does not. `partial`: a stored partial
    block (a finished request's tail), (position p, n, key, slot): the K/V of the first
    n tokens of the prompt's block p, used where the prefix reaches p."""

    request_id: int
    arena: str
    namespace: bytes
    block_keys: list[int]
    slots: list[int]
    positions: list[int]
    partial: tuple[int, int, int, int] | None = None


@dataclass
class StoreReady:
    """Worker -> supervisor, after Ready: the store namespace of the blocks this worker
    computes (everything besides the tokens that changes their bytes; cache_salt empty)
    and a block's size in bytes."""

    worker_id: int
    namespace: StoreNamespace
    block_bytes: int


@dataclass
class StorePut:
    """Worker -> supervisor: blocks for the store (evicted from the worker's pool, or
    left by a finished request, per kv_store.write_policy), as (block key, bytes)."""

    worker_id: int
    namespace: bytes
    blocks: list[tuple[int, bytes]]


@dataclass
class StoreSlots:
    """Supervisor -> worker: free slots of the store's arena (the file `arena`) reserved
    for this worker, to copy the blocks its pool evicts straight into (then StoreWritten),
    instead of sending their bytes (StorePut). Topped up as the worker uses them."""

    arena: str
    slots: list[int]


@dataclass
class StoreWritten:
    """Worker -> supervisor: it filled these reserved slots with blocks for the store and
    sealed them, as (block key, slot) in `namespace`: the supervisor commits them. Its
    pool also evicted the `refreshed` blocks without copying them (the store had them:
    written ahead, or loaded from it): the store ranks them as recent as that eviction."""

    worker_id: int
    namespace: bytes
    blocks: list[tuple[int, int]]
    refreshed: list[int] = field(default_factory=list)


@dataclass
class StoreRelease:
    """Worker -> supervisor: it has copied the StoreHits of these requests: the first
    `loaded[i]` blocks of request `request_ids[i]`'s hits went into its pool (the others
    it held already, or had no room for)."""

    worker_id: int
    request_ids: list[int]
    loaded: list[int]


# What a worker's inbox carries, and what comes back on its outbox: a handler matches on
# these unions, so a message type added here and not handled is a type error there.
ToWorker = (
    Submit
    | Handoff
    | SharePool
    | PeerPool
    | DropPeer
    | Tune
    | Release
    | Abort
    | Shutdown
    | StoreHits
    | StoreSlots
)
FromWorker = (
    Ready
    | PoolShared
    | PeerDropped
    | TokenBatch
    | HandoffResult
    | LeaseExpired
    | Failed
    | StoreReady
    | StorePut
    | StoreWritten
    | StoreRelease
)
