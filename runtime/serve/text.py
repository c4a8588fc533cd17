"""Generated ids -> the text a client sees: UTF-8 safe, stop strings cut and never half-shown."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Detokenizes one sequence's ids as they come (through Tokenizer.stream, which holds back a
    partial UTF-8 character) and applies stop strings: text that could still grow into a stop
    string is held back until it can't, and at a match the text is cut before it and `stopped`
    is set. Special tokens are not shown."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.decoder = tokenizer.stream(skip_special_tokens=True)
        self.stop = tuple(stop)
        self.pending = ""  # decoded, not yet released: the possible start of a stop string
        self.stopped = False

    def put(self, token_id: int) -> str:
        """Add one generated id; return the text that can be shown now (often '')."""
        if self.stopped:
            return ""
        return self._release(self.decoder.put(token_id), final=False)

    def finish(self) -> str:
        """The sequence ended (stop token or length): everything still held, stop strings applied."""
        if self.stopped:
            return ""
        return self._release(self.decoder.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        matches = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if matches:
            out, self.pending, self.stopped = self.pending[:min(matches)], "", True
            return out
        keep = 0 if final else self._held()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _held(self) -> int:
        """Length of the longest end of `pending` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest
