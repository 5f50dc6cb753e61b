"""The GGUF's own tokenizer through llama.cpp's vocab-only load.

Token ids are those the llama.cpp backend produces for the same text, because
it is the same code reading the same vocabulary (no weights are loaded).
"""

from __future__ import annotations

import ctypes
import os

from localinfer.errors import UnsupportedModelError

NO_VOCAB = ("none", "no_vocab")


class Tokenizer:
    """tokenize / token_bytes / bos / eos of one GGUF file."""

    def __init__(self, path: str, tokenizer_model: str | None):
        self._vocab = self._model = None
        self.has_vocab = tokenizer_model not in NO_VOCAB
        self._pieces: dict[int, bytes] = {}
        if not self.has_vocab:
            return
        import llama_cpp as L

        from localinfer.llamacpp_native import init_backend

        init_backend()  # llama.cpp's log goes to the llama.cpp backend's handler (quiet unless asked)
        self._L = L
        params = L.llama_model_default_params()
        params.vocab_only = True
        self._model = L.llama_model_load_from_file(os.fsencode(path), params)
        if not self._model:
            raise UnsupportedModelError(f"llama.cpp could not read the tokenizer of {os.path.basename(path)}",
                                        hint="check the file's tokenizer.ggml.* metadata", path=path)
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        bos = L.llama_vocab_bos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if L.llama_vocab_is_eog(self._vocab, i))

    def _need_vocab(self) -> None:
        if not self.has_vocab:
            raise UnsupportedModelError("this GGUF has no tokenizer (tokenizer.ggml.model is none)",
                                        hint="feed token ids to eval() directly")

    def tokenize(self, text: str, add_bos: bool, special: bool) -> list[int]:
        self._need_vocab()
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 8
        while True:
            buf = (self._L.llama_token * cap)()
            n = self._L.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
            if n >= 0:
                break
            cap = -n
        out = list(buf[:n])
        if add_bos and self.add_bos and self.bos_id is not None and (not out or out[0] != self.bos_id):
            out.insert(0, self.bos_id)
        return out

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is not None:
            return piece
        self._need_vocab()
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary of {self.n_vocab}")
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._L.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
            if n >= 0:
                break
            size = -n
        piece = self._pieces[token] = buf.raw[:n]
        return piece

    def close(self) -> None:
        if self._model:
            self._L.llama_model_free(self._model)
        self._model = self._vocab = None

