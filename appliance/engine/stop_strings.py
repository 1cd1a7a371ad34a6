"""Stop strings on streamed text: hold back what might be the start of a stop string."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text safe to emit and whether a stop string was hit."""

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        """`include`: the text ends after the stop string that ended it, not before (vLLM's
        include_stop_str_in_output)."""
        self.stops = stops
        self.include = include
        self.text = ""  # all text so far, cut at a stop string once one is found
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add generated text; return what can be shown now."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        hit = self._earliest_stop(start)
        if hit is not None:
            at, stop = hit
            self.text = self.text[: at + len(stop) if self.include else at]
            self.stopped = True
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The end of generation: everything not yet shown."""
        return self._emit(len(self.text))

    def _earliest_stop(self, start: int) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which (the longest of those
        starting there)."""
        found = [(i, -len(s), s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        at, _, stop = min(found)
        return at, stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
