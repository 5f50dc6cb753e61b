"""The one sanitiser: text read from a file (names, metadata, template output) made safe to print.

Every non-printable character is escaped (``\\n``, ``\\x1b``, ``\\u202e``), so a
line stays one line and cannot move a terminal's cursor, change its colours or
reverse the text that follows; long text is cut with its length noted.
"""

from __future__ import annotations

from typing import Any

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe_text(value: Any, limit: int | None = 120) -> str:
    """One printable line (``repr`` for non-strings), at most ``limit`` characters plus a length note."""
    s = value if isinstance(value, str) else repr(value)
    if s.isprintable() and (limit is None or len(s) <= limit):
        return s
    out: list[str] = []
    for ch in s:
        out.append(ch if ch.isprintable() else _escape(ch))
        if limit is not None and len(out) > limit:
            break
    text = "".join(out)
    if limit is not None and len(text) > limit:
        return text[:limit] + f"… ({len(s):,} chars)"
    return text
