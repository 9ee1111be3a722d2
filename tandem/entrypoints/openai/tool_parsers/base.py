"""The tool-call reader every parser shares: model text in, `content` and tool calls out, streamed
or whole.

A parser names its format's markers and punctuation (`CallFormat`); `CallReader` reads a message's
text as it grows. Outside a tool-call section text is content; inside, each call is a JSON object
`{"name": ..., "arguments" | "parameters": {...}}`. A call's name is sent as soon as the object's
head (`{"name": "f", "arguments": {`) is complete, then its arguments in fragments of the model's own
text, so the streamed arguments concatenate to exactly the text of the whole parse. An object whose
head has another shape (other keys first) is read whole, then sent at once.

The reader's decisions depend on the text only, never on how it was cut into pieces: fed in any
chunks, the accumulated deltas equal `parse` of the whole text (for text whose calls are complete;
a call cut short after its name went out cannot be taken back in a stream, and `parse` then gives
the whole text as content, as vLLM does). A text that ends inside the marker after a whole call
(`max_tokens` cut `</tool_call>`) keeps the call and drops the marker's fragment, streamed or not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

# The head of a call object written name first, up to the opening brace of its arguments.
_HEAD = regex.compile(
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
    r'"(?:arguments|parameters)"\s*:\s*\{'
)
_WS = " \t\r\n"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallFormat:
    """Where tool calls sit in a model's text.

    A section opens with one of `markers` (`keep_marker`: the marker is the call's own first
    character, as Llama 3's bare `{`), then `open`, then calls separated by `separator`, then
    `close`. `keep_marker`: a `{` marker is the first call's own opening brace (Llama 3's bare JSON).
    `at_start_only`: a section can only open the message (after whitespace); text after it is
    content and no section follows.
    """

    markers: tuple[str, ...]
    open: str = ""
    separator: str = ""
    close: str = ""
    keep_marker: bool = False
    at_start_only: bool = False
    make_id: Callable[[], str] = call_id


@dataclass
class ToolCallDelta:
    """A piece of one call: the first carries `id` and `name` (with `arguments` possibly empty)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    content: str | None
    calls: list[ParsedCall]


@dataclass
class Delta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add_call(self, piece: ToolCallDelta) -> None:
        # Pieces of the same call in one delta are merged: one entry per call and chunk.
        if self.calls and self.calls[-1].index == piece.index:
            last = self.calls[-1]
            last.arguments += piece.arguments
            last.id = last.id or piece.id
            last.name = last.name or piece.name
        else:
            self.calls.append(piece)


class JsonScanner:
    """Finds where the JSON object or array opening at `start` ends, as its text grows (lexically:
    strings and brackets; `json.loads` judges the rest)."""

    def __init__(self, start: int, stack: str = "") -> None:
        self.pos = start
        self.stack = list(stack)
        self.in_string = False
        self.escape = False
        self.end: int | None = None
        self.bad = False

    def advance(self, text: str) -> None:
        pos, stack = self.pos, self.stack
        while self.end is None and not self.bad and pos < len(text):
            ch = text[pos]
            pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if not stack or stack[-1] != ("{" if ch == "}" else "["):
                    self.bad = True
                else:
                    stack.pop()
                    if not stack:
                        self.end = pos
            elif not stack:
                self.bad = True  # the value must open with a bracket
        self.pos = pos


# Reader states.
CONTENT, OPEN, OBJECT, ARGS, TAIL, WHOLE, AFTER, PLAIN, BROKEN = range(9)


class CallReader:
    """Reads one message's text as it grows: `append` each new piece (or `feed` the whole text so
    far), then `finish`.

    Text that no state can read again (sent as content, or a call's arguments sent) is let go, and
    positions count from what is kept, so a piece costs what it holds plus the text not yet decided
    (a marker's possible start, a call object being read), not the message's length."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.text = ""  # the message from `base` on
        self.base = 0  # characters of the message let go
        self.pos = 0  # everything before has been sent or dropped
        self.state = CONTENT
        self.after_block = False  # whitespace right after a section is not content
        self.resume = 0  # where content restarts if the section turns out not to be tool calls
        self.seen_content = False
        self.held = ""  # whitespace between content and a section, sent if content follows
        self.content_last = False  # the last text sent was content (no section since)
        self.calls: list[ParsedCall] = []
        self.scanner: JsonScanner | None = None
        self.sent_args = 0
        # The arguments of the call being read, as sent (joined into its `arguments` once read).
        self.arg_parts: list[str] = []

    @property
    def broken(self) -> bool:
        return self.state == BROKEN

    def feed(self, text: str) -> Delta:
        """Read the whole text so far (it extends the text fed before)."""
        return self.append(text[self.base + len(self.text) :])

    def append(self, piece: str) -> Delta:
        """Read the text's next piece."""
        self._let_go()
        self.text += piece
        out = Delta()
        while self._step(out, final=False):
            pass
        return out

    def _let_go(self) -> None:
        """Drop the text before the first position the current state may still read."""
        state = self.state
        if state in (OPEN, OBJECT, WHOLE):
            keep = min(self.pos, self.resume)  # the section may yet turn out to be content
        elif state == ARGS:
            keep = self.sent_args
        elif state == TAIL:
            assert self.scanner is not None
            keep = self.scanner.pos
        elif state == PLAIN:
            keep = self.resume
        elif state == BROKEN:
            keep = len(self.text)
        else:  # CONTENT, AFTER
            keep = self.pos
        if keep <= 0:
            return
        self.text = self.text[keep:]
        self.base += keep
        # Positions a state no longer reads may fall before the kept text: they are reset before use.
        self.pos = max(0, self.pos - keep)
        self.resume = max(0, self.resume - keep)
        self.sent_args = max(0, self.sent_args - keep)
        if self.scanner is not None:
            self.scanner.pos = max(0, self.scanner.pos - keep)
            if self.scanner.end is not None:
                self.scanner.end = max(0, self.scanner.end - keep)

    def _close_args(self) -> None:
        """The current call's arguments are all read (or never will be): join them."""
        self.calls[-1].arguments = "".join(self.arg_parts)
        self.arg_parts = []

    def finish(self) -> Delta:
        out = Delta()
        while self._step(out, final=True):
            pass
        if self.state == CONTENT:
            rest = self.text[self.pos :]
            if self.after_block:
                rest = rest.lstrip(_WS)
            if rest.strip(_WS) or not self.calls:
                self._content(out, rest)
        elif self.state in (OPEN, OBJECT, WHOLE):
            self._plain(out)
        elif self.state in (ARGS, TAIL):
            if self.state == ARGS:
                self._close_args()
            self.state = BROKEN
        self.pos = len(self.text)
        return out

    # -- the states ------------------------------------------------------------------------------

    def _step(self, out: Delta, final: bool) -> bool:
        """Advance once; False when the text so far is used up (or held back)."""
        text, fmt = self.text, self.fmt
        if self.state == CONTENT:
            return self._read_content(out, final)
        if self.state == PLAIN:
            self._plain(out)
            return False
        if self.state == BROKEN:
            return False
        if self.state == OPEN:
            p = self._skip_ws(self.pos)
            if len(text) - p < len(fmt.open):
                return False
            if not text.startswith(fmt.open, p):
                self.state = PLAIN
                return True
            self.pos = p + len(fmt.open)
            self.state = OBJECT
            return True
        if self.state == OBJECT:
            p = self._skip_ws(self.pos)
            if p >= len(text):
                return False
            if text[p] != "{":
                self.state = PLAIN
                return True
            self.pos = p
            m = _HEAD.match(text, p, partial=True)
            if m is not None and m.partial:
                return False
            name = _json_string(m.group(1)) if m is not None else None
            if m is None or name is None:
                self.scanner = JsonScanner(p)
                self.state = WHOLE
                return True
            call = ParsedCall(fmt.make_id(), name, "")
            self.calls.append(call)
            out.add_call(ToolCallDelta(len(self.calls) - 1, "", call.id, name))
            self.sent_args = m.end() - 1
            self.scanner = JsonScanner(self.sent_args)
            self.state = ARGS
            return True
        if self.state == ARGS:
            sc = self.scanner
            assert sc is not None
            sc.advance(text)
            upto = sc.end if sc.end is not None else sc.pos
            if upto > self.sent_args:
                piece = text[self.sent_args : upto]
                self.arg_parts.append(piece)
                out.add_call(ToolCallDelta(len(self.calls) - 1, piece))
                self.sent_args = upto
            if sc.bad:
                self._close_args()
                self.state = BROKEN
                return False
            if sc.end is None:
                return False
            self._close_args()
            self.scanner = JsonScanner(sc.end, "{")  # the rest of the call object
            self.state = TAIL
            return True
        if self.state == TAIL:
            sc = self.scanner
            assert sc is not None
            sc.advance(text)
            if sc.bad:
                self.state = BROKEN
                return False
            if sc.end is None:
                return False
            try:
                json.loads(self.calls[-1].arguments)
            except ValueError:
                self.state = BROKEN
                return False
            self._call_done(sc.end)
            return True
        if self.state == WHOLE:
            sc = self.scanner
            assert sc is not None
            sc.advance(text)
            if sc.bad:
                self.state = PLAIN
                return True
            if sc.end is None:
                return False
            whole = _whole_call(text[self.pos : sc.end])
            if whole is None:
                self.state = PLAIN
                return True
            name, arguments = whole
            self.calls.append(ParsedCall(fmt.make_id(), name, arguments))
            out.add_call(ToolCallDelta(len(self.calls) - 1, arguments, self.calls[-1].id, name))
            self._call_done(sc.end)
            return True
        if self.state == AFTER:
            p = self._skip_ws(self.pos)
            rest = text[p:]
            for word, then in ((fmt.separator, OBJECT), (fmt.close, CONTENT)):
                if word and rest.startswith(word):
                    self.pos = p + len(word)
                    self._section_over(then)
                    return True
            waiting = any(word.startswith(rest) for word in (fmt.separator, fmt.close) if word)
            if not rest or (waiting and not final):
                return False
            if waiting:
                # The text ended inside the marker after a whole call (max_tokens cut `</tool_call>`):
                # the call stands, and a fragment of markup is not something the model said.
                self.pos = len(text)
                self._section_over(CONTENT)
                return True
            # Anything else after a call: content from here on (whitespace between dropped).
            self.pos = p
            self._section_over(CONTENT)
            return True
        raise AssertionError(self.state)

    def _call_done(self, end: int) -> None:
        self.pos = self.resume = end
        self.state = AFTER

    def _section_over(self, then: int) -> None:
        if then == OBJECT:
            self.state = OBJECT
            return
        self.after_block = True
        self.resume = self.pos
        self.state = CONTENT

    def _read_content(self, out: Delta, final: bool) -> bool:
        text, fmt = self.text, self.fmt
        if self.after_block:
            p = self._skip_ws(self.pos)
            if p == len(text):
                self.pos = p
                return False
            self.pos = p
            self.after_block = False
        if fmt.at_start_only:
            if self.seen_content or self.calls:
                self.resume = self.pos
                self.state = PLAIN
                return True
            p = self._skip_ws(self.pos)
            rest = text[p:]
            for marker in fmt.markers:
                if rest.startswith(marker):
                    self._open_section(self.pos, p, marker)
                    return True
            if rest and not final and any(m.startswith(rest) for m in fmt.markers):
                return False
            if rest:
                self.seen_content = True
                self.resume = self.pos
                self.state = PLAIN
                return True
            return False
        found = [(i, m) for m in fmt.markers if (i := text.find(m, self.pos)) >= 0]
        if found:
            i, marker = min(found)
            piece = text[self.pos : i].rstrip(_WS)
            self._content(out, piece)
            if self.content_last:
                self.held = text[self.pos + len(piece) : i]
            self._open_section(i, i, marker)
            return True
        # Hold back what may be the start of a marker, and trailing whitespace (it may precede one).
        safe = len(text)
        for m in fmt.markers:
            for k in range(min(len(m) - 1, len(text) - self.pos), 0, -1):
                if text.endswith(m[:k]):
                    safe = min(safe, len(text) - k)
                    break
        piece = text[self.pos : safe].rstrip(_WS)
        self._content(out, piece)
        self.pos += len(piece)
        return False

    def _open_section(self, resume: int, at: int, marker: str) -> None:
        # Should the section turn out not to hold calls, it is content from `resume` on.
        self.resume = resume
        self.content_last = False
        self.pos = at if self.fmt.keep_marker and marker == "{" else at + len(marker)
        self.state = OPEN

    def _plain(self, out: Delta) -> None:
        """Everything from `resume` on is content."""
        self.state = PLAIN
        self._content(out, self.text[self.resume :])
        self.pos = self.resume = len(self.text)

    def _content(self, out: Delta, piece: str) -> None:
        """Send content; whitespace held from before a section goes first (content on either side
        of a section stays apart by what separated it from the section)."""
        if piece:
            self.seen_content = True
            out.content += self.held + piece
            self.held = ""
            self.content_last = True

    def _skip_ws(self, p: int) -> int:
        text = self.text
        while p < len(text) and text[p] in _WS:
            p += 1
        return p


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def _whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object in any key order, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse(fmt: CallFormat, text: str) -> Parsed:
    """The whole message at once: the same reading as a stream, except that a call cut short or
    with arguments that are not JSON leaves the whole text as content, no calls."""
    reader = CallReader(fmt)
    content = reader.feed(text).content
    content += reader.finish().content
    if reader.broken:
        return Parsed(text, [])
    return Parsed(content or (None if reader.calls else ""), reader.calls)


@dataclass(frozen=True)
class ToolParser:
    """A `--tool-call-parser` choice: its format, and whether the model's special tokens must stay
    in the text (when the format's marker is one, as Mistral's `[TOOL_CALLS]`)."""

    name: str
    format: CallFormat
    keep_special_tokens: bool = False

    def reader(self) -> CallReader:
        return CallReader(self.format)

    def parse(self, text: str) -> Parsed:
        return parse(self.format, text)
