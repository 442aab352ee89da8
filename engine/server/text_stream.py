"""Incremental text of a request's output tokens, with stop strings.

Each update decodes the whole output and emits what is new: decoding token by token would split
characters whose UTF-8 bytes span tokens (byte-level BPE does that for accents, CJK and emoji).
Text that is not final yet is held back: a trailing U+FFFD (the first bytes of a character whose
last bytes have not been generated), and the last ``len(longest stop string) - 1`` characters,
which could be the start of a stop string that a client must never see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
Decode = Callable[[list[int]], str]


class TextStream:
    """The text of one request's output so far, and the part of it not yet sent.

    Args:
        decode: token ids -> text (``None`` when the model has no tokenizer: the text stays "").
        stop: strings that end the request; the output is cut before the first one.
    """

    def __init__(self, decode: Decode | None, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        if stop and decode is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        self._decode = decode
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self.stopped = False

    def update(self, token_ids: list[int], *, final: bool = False) -> str:
        """Take the output's token ids so far; returns the text to send now.

        Args:
            token_ids: every output token of the request so far.
            final: the request finished: send everything left.

        Returns:
            New text (maybe ""). Once a stop string shows up, ``stopped`` is set, the text ends
            before it and later updates return "".
        """
        if self._decode is None or self.stopped:
            return ""
        full = self._decode(token_ids)
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            ready = full[:cut]
        elif final:
            ready = full
        else:
            ready = full.rstrip(REPLACEMENT)
            ready = ready[: max(len(self.text), len(ready) - self._hold)]
        if ready.startswith(self.text):
            delta = ready[len(self.text) :]
        else:
            # Decoding more tokens changed earlier text (rare; not byte-level BPE): what was
            # sent stays sent, and the final text is the decoder's.
            delta = ""
        if delta or final or self.stopped:
            self.text = ready
        return delta

    def _find_stop(self, full: str) -> int | None:
        cuts = []
        for s in self._stop:
            # Text already sent held no stop string: search from where a new one could start.
            at = full.find(s, max(0, len(self.text) - len(s) + 1))
            if at != -1:
                cuts.append(at)
        return min(cuts) if cuts else None
