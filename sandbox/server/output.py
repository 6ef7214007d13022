"""What a bash command printed, as an LLM reads it: the prompt markers found, the output bounded and cleaned.

Where it sits: `server.bash.BashSession` feeds each command's pty bytes to a `Capture` until the
prompt marker with the command's tag shows; `Capture.output()` gives the text `BashResult.output` carries.

Output policy (documented in the README): at most ``max_output`` bytes are
kept — the first half and the last half of the stream — with a marker line
``[... rolloutd: N bytes truncated ...]`` between them; ANSI escapes and
control characters other than tab and newline are removed, CRLF becomes LF and
a carriage-return overwrite keeps the last segment of the line.
"""
from __future__ import annotations

HOLD = 96  # bytes held back so that a marker split across reads is still found
HEX = frozenset(b"0123456789abcdef")
# control characters other than tab and newline (CR is handled before)
CONTROL = dict.fromkeys([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])

# No `re` here: importing it (with enum, functools, ...) would cost more than the
# server's whole start on a busy node. Markers and escapes are parsed by hand.


def find_prompt(buf: bytes, tag: bytes) -> tuple[int, int, int] | None:
    """(start, end, exit code) of the prompt marker ``\\x1eRD<tag>:<code>\\x1e``."""
    prefix = b"\x1eRD" + tag + b":"
    at = buf.find(prefix)
    while at != -1:
        digits_at = at + len(prefix)
        end = buf.find(b"\x1e", digits_at)
        if end == -1:
            return None
        digits = buf[digits_at:end]
        if digits.isdigit() and len(digits) < 4:
            return at, end + 1, int(digits)
        at = buf.find(prefix, at + 1)
    return None


def strip_markers(raw: bytes) -> bytes:
    """Remove every marker, ours or stale (``\\x1eRD<hex>:<n>\\x1e``, ``\\x1eRS<hex>\\x1e``)."""
    if b"\x1e" not in raw:
        return raw
    out = bytearray()
    pos = 0
    while True:
        at = raw.find(b"\x1eR", pos)
        if at == -1:
            break
        end = raw.find(b"\x1e", at + 1)
        body = raw[at + 3 : end] if end != -1 else b""
        kind = raw[at + 2 : at + 3]
        head, _, code = body.partition(b":")
        ok = end != -1 and head and set(head) <= HEX and (
            (kind == b"S" and not _) or (kind == b"D" and code.isdigit())
        )
        if ok:
            out += raw[pos:at]
            pos = end + 1
        else:
            out += raw[pos : at + 1]
            pos = at + 1
    out += raw[pos:]
    return bytes(out)


def strip_ansi(text: str) -> str:
    """Remove escape sequences: CSI (colours, cursor), OSC (titles, links),
    DCS/SOS/PM/APC strings, and two-byte escapes."""
    if "\x1b" not in text:
        return text
    out = []
    pos = 0
    n = len(text)
    while True:
        at = text.find("\x1b", pos)
        if at == -1:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:at])
        i = at + 1
        kind = text[i] if i < n else ""
        if kind == "[":  # CSI: parameters 0x30-0x3f, intermediates 0x20-0x2f, final 0x40-0x7e
            i += 1
            while i < n and "\x30" <= text[i] <= "\x3f":
                i += 1
            while i < n and "\x20" <= text[i] <= "\x2f":
                i += 1
            pos = i + 1 if i < n and "\x40" <= text[i] <= "\x7e" else i
        elif kind == "]":  # OSC, ended by BEL or ESC \\
            bel = text.find("\x07", i)
            st = text.find("\x1b\\", i)
            ends = [e for e in ((bel, 1), (st, 2)) if e[0] != -1]
            pos = min(ends)[0] + min(ends)[1] if ends else n
        elif kind in ("P", "X", "^", "_"):  # DCS, SOS, PM, APC, ended by ESC \\
            st = text.find("\x1b\\", i)
            pos = st + 2 if st != -1 else n
        elif kind and "\x40" <= kind <= "\x5f":  # two-byte escape
            pos = i + 1
        else:
            pos = i  # a lone ESC: drop it


def clean_output(raw: bytes) -> str:
    """Bytes from the pty → text an LLM can read (see the module docstring)."""
    raw = strip_markers(raw)  # a stale prompt (e.g. after typed-ahead input) is not output
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    text = strip_ansi(text)
    if "\r" in text:
        lines = []
        for line in text.split("\n"):
            if "\r" in line:
                parts = [p for p in line.split("\r") if p]
                line = parts[-1] if parts else ""
            lines.append(line)
        text = "\n".join(lines)
    return text.translate(CONTROL)


class Capture:
    """Collects one command's output until its prompt marker; bounded memory."""

    def __init__(self, tag: str, max_output: int) -> None:
        self.tag = tag.encode()
        self.head_limit = max_output // 2
        self.tail_limit = max_output - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.hold = b""
        self.started = False  # bash has read the command line and is running the command
        self.done = False
        self.exit_code: int | None = None

    def feed(self, data: bytes) -> None:
        buf = self.hold + data
        if not self.started:
            start = b"\x1eRS" + self.tag + b"\x1e"
            at = buf.find(start)
            if at != -1:
                buf = buf[:at] + buf[at + len(start) :]
                self.started = True
        prompt = find_prompt(buf, self.tag)
        if prompt is not None:
            self._commit(buf[: prompt[0]])
            self.hold = b""
            self.exit_code = prompt[2]
            self.done = True
            return
        if len(buf) > HOLD:
            self._commit(buf[:-HOLD])
            self.hold = buf[-HOLD:]
        else:
            self.hold = buf

    def flush(self) -> None:
        """The stream ended without a marker: keep what was held back."""
        self._commit(self.hold)
        self.hold = b""

    def _commit(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_limit + 65536:
                del self.tail[: len(self.tail) - self.tail_limit]

    def output(self) -> tuple[str, bool]:
        """(cleaned text, truncated?)"""
        kept_tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        cut = self.total - len(self.head) - len(kept_tail)
        if cut <= 0:
            return clean_output(bytes(self.head) + bytes(self.tail)), False
        note = (
            f"\n[... rolloutd: {cut} bytes truncated; kept the first {len(self.head)} "
            f"and the last {len(kept_tail)} of {self.total} bytes ...]\n"
        )
        return clean_output(bytes(self.head)) + note + clean_output(kept_tail), True

