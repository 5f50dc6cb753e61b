"""SIGTERM while llama.cpp loads a tokenizer (the torch and MLX backends' VocabOnly): raised after the
load, the model freed -- not lost in llama.cpp's log callback."""

from __future__ import annotations

import os
import signal

import pytest

from localinfer.util import signals
from localinfer.util.signals import Terminated


def test_sigterm_during_a_vocab_only_load_is_raised_after_it(default_model, monkeypatch):
    import llama_cpp

    from localinfer.backends import vocab

    real_load, real_free = llama_cpp.llama_model_load_from_file, llama_cpp.llama_model_free
    freed = []

    def load(path, params):
        os.kill(os.getpid(), signal.SIGTERM)       # arrives while the load runs (and logs)
        return real_load(path, params)

    def free(model):
        freed.append(model)
        real_free(model)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", load)
    monkeypatch.setattr(llama_cpp, "llama_model_free", free)
    old = signal.getsignal(signal.SIGTERM)
    signals.install()
    try:
        with pytest.raises(Terminated):
            vocab.VocabOnly(str(default_model))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert len(freed) == 1 and signals.pending() is None
