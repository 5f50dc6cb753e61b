"""benchmarks/serve_nkv.py reads llama.cpp's find_slot debug log back into ubatches, decode rows and time by kind."""

from benchmarks.serve_nkv import decode_rows, parse, seconds_by_kind


def _slot(t: float, n: int, used: int, rows: int, cache: dict[int, int]) -> list[str]:
    """One ubatch as llama.cpp's find_slot logs it with LLAMA_KV_CACHE_DEBUG=1: for each of the ubatch's ``rows``
    sequences an "n =" line, then every sequence in the cache with its min/max positions."""
    out = []
    for _ in range(rows):
        out.append(f"{t} find_slot: stream[0], n = {n:5d}, used = {used:5d}, head = {used:5d}, size =  4096, "
                   f"n_swa =     0")
        out += [f"{t} find_slot: stream[0] min[{s}] = {0:5d}, max[{s}] = {p:5d}" for s, p in cache.items()]
    return out


def test_rows_and_kinds_from_a_log():
    lines = [
        *_slot(0.0, 0, 0, 1, {}),                       # sequence 0's 300-token prompt
        *_slot(1.0, 300, 300, 2, {0: 299}),             # 0 decodes; sequence 1's prompt, its first 200 tokens
        *_slot(1.7, 501, 501, 2, {0: 300, 1: 199}),     # 0 decodes; the last 100 of 1's prompt
        *_slot(2.1, 602, 602, 2, {0: 301, 1: 299}),     # both decode
        *_slot(2.15, 604, 604, 2, {0: 302, 1: 300}),    # both decode; 0 finishes (gone at the next ubatch)
        *_slot(2.2, 606, 303, 1, {1: 301}),             # 1 decodes and finishes
        *_slot(2.23, 0, 0, 1, {}),                      # the next request's prompt
    ]
    ub = parse(lines)
    assert [u.n for u in ub] == [0, 300, 501, 602, 604, 606, 0]
    assert [u.n_seqs for u in ub] == [1, 2, 2, 2, 2, 1, 1]
    assert ub[2].max_pos == {0: 300, 1: 199}
    # one row beside each of the two prompt chunks, two rows twice (the finishing row counted), one row at the end
    assert decode_rows(ub) == {1: 3, 2: 4}
    got = seconds_by_kind(ub)
    assert set(got) == {"prompt", "decode 2", "decode 1"}
    assert abs(got["prompt"] - 2.1) < 1e-9          # 0 -> 1.0 -> 1.7 -> 2.1: a new sequence, another, a grown one
    assert abs(got["decode 2"] - 0.1) < 1e-9        # 2.1 -> 2.15 -> 2.2
    assert abs(got["decode 1"] - 0.03) < 1e-9       # 2.2 -> 2.23
