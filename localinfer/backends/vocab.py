"""llama.cpp's tokenizer, shared by every backend.

The torch and MLX backends load a GGUF's vocabulary with llama.cpp
(``vocab_only``: the tokenizer, no weights), so all backends produce the same
token ids and the same bytes for the same text: same pre-tokenizer, same
special-token parsing, same pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import llama_cpp as _L

from localinfer.backends.llamacpp.native import init_backend, last_error, log_lock
from localinfer.errors import LocalinferError, UnsupportedModelError
from localinfer.util import signals


class LlamaVocab:
    """tokenize / token_bytes / BOS and end-of-generation ids over a llama.cpp vocabulary handle."""

    def __init__(self, vocab):
        self._vocab = vocab
        self.n_vocab = _L.llama_vocab_n_tokens(vocab)
        self.has_vocab = _L.llama_vocab_type(vocab) != _L.LLAMA_VOCAB_TYPE_NONE and self.n_vocab > 0
        self.add_bos = bool(_L.llama_vocab_get_add_bos(vocab))
        bos = _L.llama_vocab_bos(vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if _L.llama_vocab_is_eog(vocab, i))
        self._pieces: dict[int, bytes] = {}

    def _handle(self):
        if self._vocab is None:
            raise LocalinferError("this engine is closed")
        if not self.has_vocab:
            raise UnsupportedModelError("this GGUF has no tokenizer (tokenizer.ggml.model is none)",
                                        hint="feed token ids to eval() directly, or pass a full model file")
        return self._vocab

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of text; BOS is prepended only when asked and the tokenizer wants one.

        ``special=True`` parses special-token text (chat-template pieces only, never user text).
        """
        vocab = self._handle()
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 8
        while True:
            buf = (_L.llama_token * cap)()
            n = _L.llama_tokenize(vocab, data, len(data), buf, cap, False, special)
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
            vocab = self._handle()
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"token id {token} outside the vocabulary of {self.n_vocab}")
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = _L.llama_token_to_piece(vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included (for templates and display)."""
        raw = _L.llama_vocab_get_text(self._handle(), token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def release(self) -> None:
        """Forget the handle (its model was freed); later calls raise 'closed'."""
        self._vocab = None


class VocabOnly(LlamaVocab):
    """The tokenizer of one GGUF file, loaded by llama.cpp without weights."""

    def __init__(self, path: str):
        self._model = None
        init_backend()  # llama.cpp's log goes to the llama.cpp backend's capture, not stderr
        params = _L.llama_model_default_params()
        params.vocab_only = True
        with log_lock, signals.native():  # llama.cpp logs through a ctypes callback: SIGTERM is raised after
            self._model = _L.llama_model_load_from_file(os.fsencode(path), params)
            if self._model and signals.pending() is not None:
                _L.llama_model_free(self._model)
                self._model = None
                raise KeyboardInterrupt     # the main thread raises Terminated leaving the block instead
            if not self._model:
                raise UnsupportedModelError(
                    f"llama.cpp cannot read the tokenizer of {os.path.basename(path)}: {last_error()}",
                    hint="check the file with `localinfer inspect`", path=path)
        super().__init__(_L.llama_model_get_vocab(self._model))

    def close(self) -> None:
        self.release()
        if getattr(self, "_model", None) is not None:
            model, self._model = self._model, None
            with signals.native():
                _L.llama_model_free(model)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
