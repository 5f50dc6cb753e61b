"""benchmarks/serve_nkv.py reads llama.cpp's find_slot debug log back into ubatches, decode rows and time by kind."""

from benchmarks.serve_nkv import decode_rows, parse, seconds_by_kind


def _slot(t: float, n: int, used: int, rows: int, seqs: dict[int, int]) -> list[str]:
    """One ubatch as llama.cpp logs it with LLAMA_KV_CACHE_DEBUG=1: an "n =" line for each of its ``rows``
    sequences, then every sequence in the cache with its min/max positions."""
    out = [f"{t} find_slot: stream[0], n = {n:5d}, used = {used:5d}, head = {used:5d}" for _ in range(rows)]
    out += [f"{t} find_slot: stream[0] min[{s}] = {0:5d}, max[{s}] = {p:5d}" for s, p in seqs.items()]
    return out


def test_rows_and_kinds_from_a_log():
    lines = [
        *_slot(0.0, 0, 0, 1, {}),                       # sequence 0's prompt lands (nothing in the cache yet)
        *_slot(1.0, 300, 300, 2, {0: 299}),             # sequence 0 decodes one token; sequence 1's prompt lands
        *_slot(1.2, 600, 600, 2, {0: 300, 1: 299}),     # both decode
        *_slot(1.25, 602, 602, 2, {0: 301, 1: 300}),    # both decode again
        *_slot(1.30, 604, 604, 2, {0: 302, 1: 301}),    # both finish: gone at the next ubatch
        *_slot(1.40, 0, 0, 1, {}),                      # the next request's prompt
    ]
    ub = parse(lines)
    assert [u.n for u in ub] == [0, 300, 600, 602, 604, 0]
    assert ub[2].max_pos == {0: 300, 1: 299} and ub[2].n_seqs == 2
    # decode rows: ubatch 1 (sequence 0 one further; sequence 1 is new), ubatches 2 and 3 (two rows each)
    assert decode_rows(ub) == {1: 1, 2: 4}
    got = seconds_by_kind(ub)
    assert set(got) == {"prompt", "decode 2", "other"}
    assert abs(got["prompt"] - 1.2) < 1e-9          # 0 -> 1.0 (a new sequence) and 1.0 -> 1.2 (another)
    assert abs(got["decode 2"] - 0.1) < 1e-9        # 1.2 -> 1.25 -> 1.30
    assert abs(got["other"] - 0.1) < 1e-9           # the finishing step: its sequences left before the next
