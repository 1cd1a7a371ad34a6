"""When a crashed worker is started again: after a backoff that doubles with each recent
crash of its device, and never again once the device crashed too often in a short while.
Plain data, no processes: the supervisor asks, and acts on the answer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_crashes: int = 3  # this many crashes within window_s marks the device failed
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    _crashes: dict[int, list[float]] = field(default_factory=dict)  # device -> crash times

    def on_crash(self, device: int, now: float) -> float | None:
        """Record a crash of `device`'s worker at monotonic time `now`; returns how many
        seconds to wait before starting it again, or None when the device has failed."""
        recent = [t for t in self._crashes.get(device, []) if now - t < self.window_s]
        recent.append(now)
        self._crashes[device] = recent
        if len(recent) >= self.max_crashes:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (len(recent) - 1))
