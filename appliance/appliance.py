"""The in-process API the server and tests use:

async with Appliance(settings) as app:
    async for chunk in app.generate(messages=[...], params=SamplingParams(...)):
        print(chunk.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from appliance.config import Settings
from appliance.engine.sequence import SamplingParams
from appliance.model.loader import prepare_model
from appliance.model.tokenizer import Tokenizer
from appliance.supervisor import Chunk, Supervisor
from appliance.topology import Topology


class Appliance:
    """Tokenizes, then hands requests to the supervisor of the worker pools."""

    def __init__(self, settings: Settings, topology: Topology | None = None) -> None:
        self.settings = settings
        self.supervisor = Supervisor(settings, topology)
        self.tokenizer: Tokenizer | None = None

    async def __aenter__(self) -> Appliance:
        # Writes the weight cache once, if missing, before the workers read it.
        config, tokenizer_dir = prepare_model(self.settings.model, self.settings.cache_dir)
        self.tokenizer = Tokenizer.load(tokenizer_dir, config.eos_token_ids)
        await self.supervisor.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.supervisor.stop()

    def generate(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream a completion of a raw prompt (text or token ids) or of chat messages."""
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or messages")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        return self.supervisor.generate(ids, params or SamplingParams())
