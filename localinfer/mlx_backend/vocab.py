"""Tokenization through llama.cpp's own vocabulary code (a vocab-only model load).

Loading the GGUF with ``vocab_only`` reads the tokenizer and no weights, so
the mlx backend produces exactly the token ids and bytes the llama.cpp
backend does: same pre-tokenizer, same special-token parsing, same pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import llama_cpp as _L

from ..errors import LocalinferError, UnsupportedModelError
from ..llamacpp_native import init_backend, last_error, log_lock


class Vocab:
    """tokenize / token_bytes / end-of-generation ids of one GGUF file."""

    def __init__(self, path: str):
        init_backend()  # llama.cpp's log goes to the llama.cpp backend's capture, not stderr
        params = _L.llama_model_default_params()
        params.vocab_only = True
        with log_lock:
            self._model = _L.llama_model_load_from_file(os.fsencode(path), params)
            if not self._model:
                raise UnsupportedModelError(
                    f"llama.cpp cannot read the tokenizer of {os.path.basename(path)}: {last_error()}",
                    hint="check the file with `localinfer inspect`", path=path)
        self._vocab = _L.llama_model_get_vocab(self._model)
        self.n_tokens = _L.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(_L.llama_vocab_get_add_bos(self._vocab))
        bos = _L.llama_vocab_bos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_ids = frozenset(i for i in range(self.n_tokens) if _L.llama_vocab_is_eog(self._vocab, i))
        self._pieces: dict[int, bytes] = {}

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids; BOS is prepended only when asked and the tokenizer wants one."""
        self._alive()
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 8
        while True:
            buf = (_L.llama_token * cap)()
            n = _L.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
            if n >= 0:
                break
            cap = -n
        out = list(buf[:n])
        if add_bos and self.add_bos and self.bos_id is not None and (not out or out[0] != self.bos_id):
            out.insert(0, self.bos_id)
        return out

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to output text (special tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            self._alive()
            if not 0 <= token < self.n_tokens:
                raise ValueError(f"token id {token} outside the vocabulary of {self.n_tokens}")
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = _L.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included (for templates and display)."""
        self._alive()
        raw = _L.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def _alive(self) -> None:
        if self._model is None:
            raise LocalinferError("this engine is closed")

    def close(self) -> None:
        if getattr(self, "_model", None) is not None:
            _L.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
