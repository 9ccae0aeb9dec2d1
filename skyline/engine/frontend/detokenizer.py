"""Incremental detokenization with stop strings, for streaming.

Text is decoded from a sliding window of token ids (the prefix/read-offset method): the text of
the window is compared with the text of its prefix, and only a complete tail is released, so a
UTF-8 character split over tokens (byte-fallback or byte-level pieces) is never emitted half.
Any tail that could be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from skyline.engine.frontend.tokenizer import Tokenizer

_PROMPT_CONTEXT = 6  # prompt tokens decoded before the output, for correct leading spaces


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    `step(ids)` returns the newly released text; `stop_matched` is the stop string that ended
    the text (None until one does; afterwards `step` returns ""). `text` is all text released so
    far; `flush()` releases what was held back, at the end of the request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_matched: str | None = None
        # Decoding the last prompt tokens first gives the first output token its leading space
        # (SentencePiece decoders strip a space at the start of a sequence).
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # all decoded output text, released or held back
        self._released = 0  # chars of _decoded given out
        self._finished = False

    @property
    def text(self) -> str:
        return self._decoded[: self._released]

    def step(self, new_token_ids: list[int]) -> str:
        if self._finished:
            return ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._decoded += self._decode_tail(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Release everything still held back (an incomplete character decodes as U+FFFD)."""
        if self._finished:
            return ""
        self._decoded += self._decode_tail(final=True)
        out = self._release(final=True)
        self._finished = True
        return out

    def _decode_tail(self, final: bool) -> str:
        ids, dec = self._ids, self.tokenizer.decode
        prefix = dec(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = dec(ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _release(self, final: bool) -> str:
        text, start = self._decoded, self._released
        # A stop string cannot begin in released text: its start would have been held back.
        match = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos >= 0 and (match is None or pos < match[0]):
                match = (pos, s)
        if match is not None:
            pos, s = match
            end = pos + len(s) if self.include_stop_str_in_output else pos
            self.stop_matched = s
            self._finished = True
            self._decoded = text[:end]
            self._released = end
            return text[start:end]
        end = len(text) if final else len(text) - self._held_back(text, start)
        self._released = end
        return text[start:end]

    def _held_back(self, text: str, start: int) -> int:
        """Length of the longest tail of text[start:] that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - start), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
