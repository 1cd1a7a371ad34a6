"""The in-process API the server and tests use, and the one module they import it from:

    from appliance.api import Appliance, SamplingParams, load_settings

    async with Appliance(load_settings()) as app:
        async for chunk in app.generate(messages=[...], params=SamplingParams(...)):
            print(chunk.text, end="")

The HTTP server reads the pools through this facade and the read-only pool state only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from appliance.core.tuning import Tuning, TuningPatch
from appliance.engine.sampling.logprobs import TokenLogprobs as TokenLogprobs
from appliance.engine.sequence import SamplingParams as SamplingParams
from appliance.model.model_config import ModelConfig, check_degree
from appliance.model.model_source import model_name, prepare_model
from appliance.model.sampling_defaults import SamplingDefaults, read_sampling_defaults
from appliance.model.tokenizer import Tokenizer
from appliance.ops.autopilot import Autopilot
from appliance.ops.pool_moves import MoveError as MoveError
from appliance.ops.pool_moves import PoolMover
from appliance.planner.profile import Profile
from appliance.pools.pool_state import PoolState
from appliance.pools.request_flow import Chunk as Chunk
from appliance.pools.request_flow import RequestFailed as RequestFailed
from appliance.pools.supervisor import Supervisor, online_profile
from appliance.settings.config import Settings
from appliance.settings.config import load_settings as load_settings
from appliance.topology.devices import Topology

log = logging.getLogger("appliance")


class Appliance:
    """Tokenizes, then hands requests to the supervisor of the worker pools."""

    def __init__(self, settings: Settings, topology: Topology | None = None) -> None:
        self.settings = settings
        self.supervisor = Supervisor(settings, topology)
        self.pools = PoolMover(self.supervisor, settings.admin.drain_timeout_s)
        self.autopilot = Autopilot(self.supervisor, self.pools, settings)
        self.tokenizer: Tokenizer | None = None
        self.config: ModelConfig | None = None
        self.sampling_defaults = SamplingDefaults()  # the model's, once prepared
        self.model_name = settings.served_model_name or model_name(settings.model)

    def prepare(self) -> None:
        """Load the tokenizer and the model's facts; raises ModelLoadError for a bad model.
        Reads no weights: the first worker that needs dense ones writes their cache."""
        settings = self.settings
        log.info("loading the tokenizer of %s...", self.model_name)
        began = time.monotonic()
        self.config, model_dir = prepare_model(settings.model, settings.cache_dir)
        eos_ids = self.config.eos_token_ids
        self.tokenizer = Tokenizer.load(model_dir, eos_ids, settings.chat_template)
        self.sampling_defaults = read_sampling_defaults(
            settings.generation_config, model_dir, settings.override_generation_config
        )
        log.info(
            "tokenizer loaded in %.1f s (%d tokens, %s, context %d)",
            time.monotonic() - began,
            self.tokenizer.vocab_size,
            self.config.architecture,
            self.config.max_position_embeddings,
        )
        if self.sampling_defaults.values:
            log.info(
                "sampling defaults for the fields a request leaves out: %s (from %s; "
                "generation_config=vllm keeps the API's own)",
                self.sampling_defaults.describe(),
                self.sampling_defaults.source,
            )
        check_degree(self.config, settings.prefill_tp, "prefill_tp")
        check_degree(self.config, settings.decode_tp, "decode_tp")

    @property
    def model_config(self) -> ModelConfig:
        """The model's facts, which prepare() reads."""
        if self.config is None:
            raise RuntimeError("the appliance is not prepared: prepare() reads the model")
        return self.config

    def _prepared_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError("the appliance is not prepared: prepare() loads the tokenizer")
        return self.tokenizer

    async def start(self) -> None:
        """Spawn the pools' workers and wait until all are ready."""
        log.info("starting the workers: each loads the model...")
        await self.supervisor.start()
        self.autopilot.start()

    async def stop(self) -> None:
        await self.autopilot.stop()
        await self.pools.stop()
        await self.supervisor.stop()

    async def __aenter__(self) -> Appliance:
        self.prepare()
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def ready(self) -> bool:
        return self.supervisor.ready

    @property
    def state(self) -> PoolState:
        """The pools as the server, admin API and metrics read them: read-only, so what
        they do goes through this class's methods (tune, generate_ids, pools)."""
        return self.supervisor

    def profile(self) -> Profile | None:
        """The step costs the planner plans with now: this box's profile on disk refined by
        the steps the workers ran lately, or those steps alone (None: neither yet)."""
        return online_profile(self.supervisor, self.autopilot.profile)

    def tune(self, patch: TuningPatch) -> Tuning:
        """Apply new knobs now and return those in force. Raises ValueError for a bad
        value (pydantic's ValidationError) or a combination the pools' layout refuses."""
        return self.supervisor.tune(patch)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have: the model's context, the
        configured limit, and what every worker's KV pool can hold."""
        context = self.model_config.max_position_embeddings
        limit = min(self.settings.batch.max_model_len or context, context)
        return min(limit, self.supervisor.capacity_tokens())

    def tokenize(
        self, prompt: str | list[int] | None = None, messages: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a raw prompt (text or ids) or of chat messages through the template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or messages")
        if messages is not None:
            ids = self._prepared_tokenizer().apply_chat_template(messages)
        elif isinstance(prompt, str):
            ids = self._prepared_tokenizer().encode(prompt)
        else:
            assert prompt is not None  # exactly one of prompt and messages: checked above
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def generate(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream a completion of a raw prompt (text or token ids) or of chat messages."""
        ids = self.tokenize(prompt, messages)
        return self.generate_ids(ids, params or SamplingParams())

    def generate_ids(self, ids: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream a completion of prompt token ids the caller has checked (not empty,
        inside the vocabulary and the context)."""
        return self.supervisor.generate(ids, params)
