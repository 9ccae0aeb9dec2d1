"""The model's text -> content and tool calls, as it streams (one parser for every format).

`ToolCallStream.feed(delta)` returns what the new text decides: content, and pieces of calls —
a call's id and name once its name is complete, then its arguments as they grow (an object's
raw JSON text, unchanged). Text that could still open a call (a marker's first characters) is
held back until it is decided. Text that turns out not to be a call (no valid name, a broken
object before its name, text among the calls) comes back as content. A call whose name was
sent but whose JSON then breaks cannot be taken back while streaming: `broken` says so, and
`parse_tool_calls` (the whole text at once) then answers everything as content.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from skyline.server.tool_parsers.base import ToolFormat
from skyline.server.tool_parsers.json_scan import ObjectScanner

_CONTENT, _CALLS, _PLAIN = "content", "calls", "plain"  # what the parser reads now


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text of an object, once complete


@dataclass
class CallPiece:
    """Part of a streamed call: the first piece has its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class Delta:
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)


class ToolCallStream:
    """One choice's output, parsed as it arrives. `names`: the tools the request offers (a
    call of any other name is text); `parallel` false keeps the first call only."""

    def __init__(self, fmt: ToolFormat, names: Collection[str], parallel: bool = True) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.parallel = parallel
        self.text = ""
        self.calls: list[ToolCall] = []
        self.broken = False
        self._mode = _CONTENT
        self._pos = 0  # text before it is decided (content sent, or read as calls)
        self._scan = 0  # where reading the calls has got to
        self._region_calls = 0  # calls started since the calls began
        self._obj: ObjectScanner | None = None
        self._call: ToolCall | None = None  # the call being streamed (its name was sent)
        self._skip = False  # the object read now is a call dropped (parallel off)
        self._sent = 0  # characters of the current call's arguments sent
        # separators and markers, longest first (so that "<tool_call>" is not read as "<")
        self._between = sorted({*fmt.separators, *fmt.markers}, key=len, reverse=True)

    def feed(self, delta: str) -> Delta:
        self.text += delta
        out = Delta()
        while self._advance(out):
            pass
        return out

    def finish(self) -> Delta:
        """The end of the output: what was held back."""
        out = Delta()
        if self._mode == _CALLS:
            if self._call is not None:
                self.broken = True  # its object never closed
                self._pos = len(self.text)
            elif self._region_calls == 0:
                out.content += self.text[self._pos :]  # a marker, and no call after it
            else:
                start = self._obj.start if self._obj is not None else len(self.text)
                out.content += self.text[start :]
            return out
        out.content += self.text[self._pos :]
        self._pos = len(self.text)
        return out

    # ------------------------------------------------------------------ reading

    def _advance(self, out: Delta) -> bool:
        """Read on; False when the text so far is read."""
        if self._mode == _PLAIN:
            out.content += self.text[self._pos :]
            self._pos = len(self.text)
            return False
        if self._mode == _CONTENT:
            return self._read_content(out)
        if self._obj is not None:
            return self._read_object(out)
        return self._read_between(out)

    def _read_content(self, out: Delta) -> bool:
        t, fmt = self.text, self.fmt
        if not fmt.anywhere:  # calls only at the very start of the output
            rest = t[self._pos :]
            body = rest.lstrip()
            start = self._pos + len(rest) - len(body)
            if not body:
                return False
            if (fmt.bare_json and body[0] == "{") or body.startswith(fmt.markers):
                self._open(start)
                return True
            if any(m.startswith(body) for m in fmt.markers):
                return False  # a marker's first characters: wait
            self._mode = _PLAIN
            return True
        found = [k for k in (t.find(m, self._pos) for m in fmt.markers) if k >= 0]
        if found:
            k = min(found)
            out.content += t[self._pos : k]
            self._open(k)
            return True
        end = len(t) - _partial_tail(t, self._pos, fmt.markers)
        out.content += t[self._pos : end]
        self._pos = end
        return False

    def _open(self, k: int) -> None:
        self._mode, self._pos, self._scan, self._region_calls = _CALLS, k, k, 0

    def _read_between(self, out: Delta) -> bool:
        t = self.text
        i = self._scan
        while i < len(t) and t[i].isspace():
            i += 1
        self._scan = i
        if i == len(t):
            return False
        if t[i] == "{":
            self._obj = ObjectScanner(i)
            return True
        for sep in self._between:
            if t.startswith(sep, i):
                self._scan = i + len(sep)
                return True
        if any(sep.startswith(t[i:]) for sep in self._between):
            return False  # a separator's first characters: wait
        self._end_calls(i, out)
        return True

    def _end_calls(self, i: int, out: Delta) -> None:
        """The calls end at `i`, where text that is no call begins."""
        if self._region_calls == 0:
            out.content += self.text[self._pos : i]  # the marker opened no call: text
        self._pos = i
        self._mode = _CONTENT if self.fmt.anywhere else _PLAIN

    def _read_object(self, out: Delta) -> bool:
        obj = self._obj
        assert obj is not None
        t = self.text
        obj.feed(t)
        if self._call is None and not self._skip and not self._start_call(obj, out):
            return self._drop_object(obj, out)
        if self._call is not None:
            self._send_arguments(obj, out)
        if obj.error:
            return self._drop_object(obj, out)
        if obj.end is None:
            return False
        try:
            value = obj.value(t)
        except ValueError:
            return self._drop_object(obj, out)
        if not isinstance(value, dict) or not self._finish_call(value, out):
            return self._drop_object(obj, out)
        self._obj, self._call, self._skip, self._scan = None, None, False, obj.end
        return True

    def _start_call(self, obj: ObjectScanner, out: Delta) -> bool:
        """Send the call's id and name once its name is read; False if it is no call."""
        span = obj.fields.get("name")
        if span is None or span[1] is None:
            return not obj.done  # wait for the name (an object closed without one is no call)
        try:
            name = json.loads(self.text[span[0] : span[1]])
        except ValueError:
            return False
        if not isinstance(name, str) or (self.names and name not in self.names):
            return False
        self._region_calls += 1
        if self.calls and not self.parallel:
            self._skip = True
            return True
        self._call = ToolCall(self.fmt.new_call_id(), name)
        self._sent = 0
        self.calls.append(self._call)
        out.calls.append(CallPiece(len(self.calls) - 1, "", self._call.id, name))
        return True

    def _arguments_span(self, obj: ObjectScanner) -> list[int | None] | None:
        for key in self.fmt.arguments_keys:
            if key in obj.fields:
                return obj.fields[key]
        return None

    def _send_arguments(self, obj: ObjectScanner, out: Delta) -> None:
        """Stream an object's (or array's) arguments as their text grows; a string holding
        JSON text is sent when complete (`_finish_call`)."""
        span = self._arguments_span(obj)
        if span is None or self.text[span[0]] not in "{[":
            return
        end = span[1] if span[1] is not None else obj.scanned
        self._send(self.text[span[0] + self._sent : end], out)

    def _send(self, piece: str, out: Delta) -> None:
        if piece:
            assert self._call is not None
            self._call.arguments += piece
            self._sent += len(piece)
            out.calls.append(CallPiece(len(self.calls) - 1, piece))

    def _finish_call(self, value: dict[str, Any], out: Delta) -> bool:
        """Check a closed call object; send what is left of its arguments. False if it is no
        valid call."""
        if self._skip:
            return True
        args = next((value[k] for k in self.fmt.arguments_keys if k in value), {})
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                return False
            text = args
        else:
            parsed, text = args, None
        if not isinstance(parsed, dict):
            return False
        if text is None and self._call is not None and self._sent == 0:
            text = json.dumps(parsed, ensure_ascii=False)  # no arguments key: {}
        if text is not None and self._sent == 0:
            self._send(text, out)
        return True

    def _drop_object(self, obj: ObjectScanner, out: Delta) -> bool:
        """The object read is no call. Before its name was sent, it ends the calls (it is
        text); after, the call is broken and the rest is text."""
        if self._call is None:
            self._obj, self._skip = None, False
            self._end_calls(obj.start, out)
            return True
        self.broken = True
        self._obj, self._call = None, None
        self._pos = obj.scanned
        self._mode = _PLAIN
        return True


def _partial_tail(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of a marker."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def parse_tool_calls(fmt: ToolFormat, text: str, names: Collection[str],
                     parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None if only whitespace beside calls) and calls; an output
    with a broken call is all content."""
    s = ToolCallStream(fmt, names, parallel)
    content = s.feed(text).content + s.finish().content
    if s.broken or not s.calls:
        return text, []
    return (content if content.strip() else None), s.calls
