"""``StopStrings``: end a streamed text at the first stop string, which is not returned (OpenAI's ``stop``).

Stop strings are matched on the text, not on token ids, so a string spanning several tokens (or a cycle
that commits several tokens at once) stops exactly where it begins. While the text so far ends with the
beginning of a stop string, that tail is held back: it is sent once the next text rules the stop out, or
at the end of the request.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after any held tail) that can be sent now; sets ``stopped`` at a stop string."""
        if not self.stops:
            return text
        pending = self._held + text
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return pending[:cut]
        keep = max((n for s in self.stops for n in range(1, len(s)) if pending.endswith(s[:n])), default=0)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """The held tail, at the end of the request (no stop string followed)."""
        held, self._held = self._held, ""
        return held
