"""A fixture the host-split tests share: a GPU too small to hold tests/support/tiny_moe.py's model, whose host is
the DDR5 desktop profile."""

import pytest

from localinfer.devices.profiles import profile_from_dict


@pytest.fixture(scope="module")
def gpu():
    return profile_from_dict({"name": "tiny-gpu", "kind": "cuda", "memory": "500MiB", "bandwidth": "1000GB/s",
                              "bf16_flops": 100e12, "link": {"per_direction": "32GB/s"}, "host": "ddr5-5600-2ch"})
