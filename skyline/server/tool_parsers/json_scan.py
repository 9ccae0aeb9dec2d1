"""An incremental scanner of one JSON object in a growing text: where its top-level values
start and end, before the object is complete (a streamed tool call's name and arguments)."""

from __future__ import annotations

import json
from typing import Any

_SPACE = " \t\r\n"


class ObjectScanner:
    """Scans the object that starts at `text[start] == "{"`; `feed(text)` advances over what
    the text holds so far (the text only grows). Each top-level key maps to its value's
    [start, end) in the text, `end` None while the value is incomplete. `end` is set once the
    object closes; `error` once the text cannot be this object (the caller then checks the
    whole with json.loads anyway: the scanner only locates)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self.error = False
        self.fields: dict[str, list[int | None]] = {}
        self._i = start
        self._depth = 0
        self._in_str = False
        self._esc = False
        # at depth 1: key | in_key | colon | value_wait | value (a scalar) | after_value
        self._state = "key"
        self._mark = 0  # where the key being read starts
        self._key = ""
        self._last = 0  # end of a scalar value read so far

    @property
    def scanned(self) -> int:
        """Where scanning has got to in the text."""
        return self._i

    @property
    def done(self) -> bool:
        return self.end is not None or self.error

    def value(self, text: str) -> Any:
        """The whole object, parsed (ValueError if it is not valid JSON)."""
        assert self.end is not None
        return json.loads(text[self.start : self.end])

    def feed(self, text: str) -> None:
        while self._i < len(text) and not self.done:
            self._step(text, text[self._i])
            self._i += 1

    def _close_value(self, end: int) -> None:
        field = self.fields.get(self._key)
        if field is not None and field[1] is None:
            field[1] = end

    def _step(self, text: str, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1 and self._state == "in_key":
                    self._key = json.loads(text[self._mark : self._i + 1])
                    self._state = "colon"
                elif self._depth == 1:  # a string value ends
                    self._close_value(self._i + 1)
                    self._state = "after_value"
            return
        if self._depth >= 2:  # inside a nested value
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._close_value(self._i + 1)
                    self._state = "after_value"
            return
        if c in _SPACE:
            return
        if self._depth == 0:
            if c == "{":
                self._depth = 1
            else:
                self.error = True
            return
        state = self._state
        if state == "key":
            if c == '"':
                self._in_str, self._state, self._mark = True, "in_key", self._i
            elif c == "}" and not self.fields:
                self.end = self._i + 1
            else:
                self.error = True
        elif state == "colon":
            if c == ":":
                self._state = "value_wait"
            else:
                self.error = True
        elif state == "value_wait":
            self.fields[self._key] = [self._i, None]
            if c == '"':
                self._in_str = True
                self._state = "value"
            elif c in "{[":
                self._depth += 1
                self._state = "value"
            else:
                self._state, self._last = "value", self._i + 1
        elif c in ",}":  # value or after_value
            if state == "value":
                self._close_value(self._last)
            self._state = "key"
            if c == "}":
                self.end = self._i + 1
        elif state == "value":
            self._last = self._i + 1
        else:
            self.error = True
