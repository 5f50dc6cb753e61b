"""The GGUF's own tokenizer, through llama.cpp's vocab-only load (shared with every backend).

Token ids are those the llama.cpp backend produces for the same text, because
it is the same code reading the same vocabulary (no weights are loaded).
"""

from __future__ import annotations

from localinfer.errors import UnsupportedModelError

NO_VOCAB = ("none", "no_vocab")


class NoVocab:
    """Stands in for the tokenizer of a GGUF without one: token ids only."""

    has_vocab = False
    add_bos = False
    bos_id = None
    eos_ids: frozenset[int] = frozenset()

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        raise UnsupportedModelError("this GGUF has no tokenizer (tokenizer.ggml.model is none)",
                                    hint="feed token ids to eval() directly")

    def token_bytes(self, token: int) -> bytes:
        self.tokenize("")
        return b""

    def close(self) -> None:
        pass


def load_tokenizer(path: str, tokenizer_model: str | None):
    """llama.cpp's tokenizer of the file, or NoVocab when the file declares none."""
    if tokenizer_model in NO_VOCAB:
        return NoVocab()
    from localinfer.backends.vocab import VocabOnly

    return VocabOnly(path)
