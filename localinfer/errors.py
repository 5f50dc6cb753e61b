"""Typed errors: the library raises these, the CLI turns them into one line.

Every error carries the facts (field, needed vs available, offsets) as
attributes and a ``hint`` saying how to fix it.  The CLI prints
``error: <message>`` and ``hint: <hint>`` and exits non-zero; set
``LOCALINFER_DEBUG=1`` or pass ``--debug`` to see the traceback.
"""

from __future__ import annotations

from gguf_tools.errors import GGUFFormatError

__all__ = [
    "LocalinferError",
    "UsageError",
    "ModelNotFoundError",
    "GGUFFormatError",
    "UnsupportedModelError",
    "DoesNotFitError",
    "BackendUnavailableError",
    "TemplateError",
    "GrammarError",
    "ContextFullError",
    "ProfileError",
    "OutputError",
    "RemoteServerError",
    "WorkerError",
    "DryRunError",
    "exit_code",
]


class LocalinferError(Exception):
    """Base class of every error localinfer raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, **facts):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.facts = facts
        for key, value in facts.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message


class UsageError(LocalinferError):
    """A flag or argument the user gave is invalid; names the flag and accepted values."""

    exit_code = 2

    def __init__(self, message: str, *, flag: str | None = None, hint: str | None = None, **facts):
        super().__init__(message, hint=hint, flag=flag, **facts)


class ModelNotFoundError(LocalinferError):
    """The model path does not exist or cannot be read."""


class UnsupportedModelError(LocalinferError):
    """The file is a valid GGUF but not something this backend/command can run."""


class DoesNotFitError(LocalinferError):
    """A plan needs more memory than the device has (needed vs available in bytes)."""

    def __init__(self, message: str, *, needed: int, available: int, hint: str | None = None, **facts):
        super().__init__(message, hint=hint, needed=needed, available=available, **facts)


class BackendUnavailableError(LocalinferError):
    """A backend's package is not installed or cannot start on this machine."""


class TemplateError(LocalinferError):
    """A chat template failed to render, was refused by the sandbox, or ran too long."""


class GrammarError(UsageError):
    """A JSON schema, regex, choice list, Lark grammar or tool definition that cannot be compiled to a grammar;
    ``field`` names where it came from (``response_format.json_schema.schema``, ``--grammar``)."""

    def __init__(self, message: str, *, field: str, hint: str | None = None, **facts):
        super().__init__(message, flag=field, hint=hint, field=field, **facts)


class ContextFullError(LocalinferError):
    """The prompt (or prompt plus reservation) does not fit in the context."""


class ProfileError(LocalinferError):
    """A device profile file is malformed or names an unknown device."""


class OutputError(LocalinferError):
    """A file to write cannot be written: the path names a folder, its folder is missing, read-only or full."""


class RemoteServerError(LocalinferError):
    """A server being load-tested cannot be reached, did not start, or answered outside the OpenAI API."""


class WorkerError(LocalinferError):
    """A llama.cpp RPC worker cannot be reached, is busy, speaks another protocol version, or went away."""

    exit_code = 4


class DryRunError(LocalinferError):
    """llama.cpp's own dry run of a model did not answer: it refused the file (``reason="refused"``), could not
    create a context for a request ("context"), crashed or aborted ("crashed"), or ran past its time ("timeout").
    ``log`` holds the last error lines of llama.cpp's log (its refusal message), ``path`` the model file."""


def exit_code(exc: BaseException) -> int:
    """Process exit status for an exception reaching the CLI boundary."""
    if isinstance(exc, LocalinferError):
        return exc.exit_code
    if isinstance(exc, GGUFFormatError):
        return 3
    return 1
