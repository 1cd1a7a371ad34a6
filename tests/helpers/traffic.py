"""A steady stream of chat requests in background threads, through the official openai
client, recording every outcome: for tests that change the pools while serving."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from openai import OpenAI

from appliance.model.model_source import model_name


@dataclass
class Traffic:
    """`concurrency` clients, each sending streamed requests one after another until stopped."""

    url: str
    api_key: str
    concurrency: int = 2
    max_tokens: int = 12
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Traffic:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a request hung"

    def wait_completed(self, count: int, bound_s: float = 120.0) -> None:
        """Block until `count` requests in all have completed."""
        deadline = time.monotonic() + bound_s
        while self.completed < count and not self.errors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.completed} of {count} requests completed")
            time.sleep(0.1)

    def _client(self, index: int) -> None:
        client = OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0)
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self._one(client, f"Client {index}, request {n}: name a colour.")
            except Exception as exc:  # recorded: a test asserts there are none
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    def _one(self, client: OpenAI, content: str) -> None:
        stream = client.chat.completions.create(
            model=model_name(None),
            messages=[{"role": "user", "content": content}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            timeout=120,
        )
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
        if reasons[-1] not in ("stop", "length"):
            raise RuntimeError(f"stream ended without a finish reason: {reasons[-3:]}")
        with self._lock:
            self.completed += 1
