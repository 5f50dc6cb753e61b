"""The single error type of the GGUF layer."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``...).

    Names read from a hostile file end up in messages; escaped, a message stays
    on one line and cannot move a terminal's cursor or change its colours.
    """
    from gguf_tools.text import safe_text

    return safe_text(text, limit=None)


class GGUFFormatError(ValueError):
    """A file is not a GGUF, or its header is malformed, inconsistent or truncated.

    Attributes:
        field: the header field being parsed (e.g. ``"n_tensors"``, ``"kv[12].key"``,
            ``"tensor[3].offset"``) or ``"file"``.
        offset: byte offset in the file where the problem was found (or ``None``).
        path: the file, when known.
        hint: one line telling the user what to do.
        facts: extra numbers (``needed``, ``available``, ``limit``...).
    """

    def __init__(
        self,
        message: str,
        *,
        field: str = "file",
        offset: int | None = None,
        path: str | None = None,
        hint: str | None = None,
        **facts,
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        self.offset = offset
        self.path = path
        self.hint = hint
        self.facts = facts

    def __str__(self) -> str:
        where = f" (field {self.field}" + (f", offset {self.offset}" if self.offset is not None else "") + ")"
        prefix = f"{self.path}: " if self.path else ""
        return printable(f"{prefix}{self.message}{where}")
