"""ReplyText: the incremental reply text Runner, the batch and the HTTP server share."""

from localinfer.generation.text import ReplyText
from localinfer.serve import batch
from localinfer.serve.http.responses import TextStream

PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xe2\x82", 6: b"\xac", 7: b"\xe2", 9: b"</s>"}


def test_utf8_across_tokens_stops_cut_and_the_tail_flushed_once():
    r = ReplyText(PIECES.__getitem__, ["lo w"])
    assert [r.feed(t) for t in (1, 2, 3)] == ["He", "l", ""] and r.stopped
    assert r.feed(4) == "" and r.flush() == "" and r.offset == 3 and r.tokens == 4
    u = ReplyText(PIECES.__getitem__, [], eos_ids={9})
    assert [u.feed(t) for t in (5, 6, 9, 7)] == ["", "€", "", ""]
    assert u.flush() == "" and u.flush() == "" and u.offset == 1     # a character cut at the end is left out


def test_the_batch_and_the_server_use_it():
    assert issubclass(TextStream, ReplyText)

    class Vocab:
        token_bytes = staticmethod(PIECES.__getitem__)

    rep = batch._Reply(Vocab(), ["ld"], frozenset({9}))
    assert isinstance(rep.reply, ReplyText)
    assert [rep.add(t, 0.0) for t in (9, 1, 2, 3, 4)] == [False, False, False, False, True]
    assert rep.text() == "Hello wor" and rep.tokens == [1, 2, 3, 4] and rep.stopped
