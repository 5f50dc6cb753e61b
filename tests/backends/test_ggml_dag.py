"""ggml_dag records a graph in ggml_build_forward_expand's order (sources first, left to right, leafs apart)."""

from __future__ import annotations

from localinfer.backends.llamacpp.compute_buffer import _replay
from localinfer.backends.llamacpp.ggml_dag import Dag


def test_expand_visits_sources_depth_first_and_keeps_leafs_apart():
    d = Dag()
    a, b = d.input((4,), 4), d.input((8,), 4)
    w = d.weight()
    x = d.f32("MUL_MAT", (4,), w, a)
    early = d.f32("GET_ROWS", (8,), w, b)
    d.expand(early)                       # expanded first: placed first although created later
    y = d.f32("ADD", (4,), x, d.view(early, (4,)))
    d.expand(y)
    d.expand(y)                           # a second expansion adds nothing
    assert d.g.nodes[0] == early and d.g.nodes[1] == x and d.g.nodes[-1] == y
    assert [t for t in d.g.leafs if t != w] == [b, a]
    assert d.g.view_src[d.g.nodes[2]] == early


def test_views_share_their_base_and_writes_into_caches_take_no_bytes():
    d = Dag()
    x = d.f32("GET_ROWS", (16, 4), d.weight(), d.input((4,), 4))
    cache = d.cache()
    v = d.view(d.view(x, (64,)), (8, 8), contiguous=False)
    assert d.g.view_src[v] == x
    w = d.into("CPY", cache, v, d.view(cache, (8, 8)))
    assert d.g.size[w] == 0 and d.g.view_src[w] == cache
    d.expand(w)
    assert _replay(d.g, 32, d.g.size) == 16 * 4 * 4 + 32     # x and the 16-byte token ids (padded to 32)
