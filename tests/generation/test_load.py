"""load_plan: options checked against the model and this machine."""

from __future__ import annotations

import pytest

from localinfer.errors import UsageError
from localinfer.generation.load import load_plan, open_model, usable_cores


def test_threads_are_capped_at_the_cores_this_process_may_use():
    # was: -t 1000 gave 1001 threads on 2 cores (0.1 tok/s)
    m = open_model()
    cores = usable_cores()
    assert load_plan(m.path, m.spec, n_threads=1000).threads == cores
    assert load_plan(m.path, m.spec, n_threads=1).threads == 1
    for bad in (0, -1, 1025):
        with pytest.raises(UsageError):
            load_plan(m.path, m.spec, n_threads=bad)


def test_gpu_layers_beyond_int32_are_refused_not_truncated():
    # llama.cpp takes n_gpu_layers as an int32: 2^32 would have become 0 layers on the GPU
    m = open_model()
    assert load_plan(m.path, m.spec, n_gpu_layers=999).n_gpu_layers == 999        # "all", as llama.cpp reads it
    with pytest.raises(UsageError) as ei:
        load_plan(m.path, m.spec, n_gpu_layers=1 << 32)
    assert ei.value.flag == "--gpu-layers"
