"""``StopStrings`` against the plain definition: the text before the first occurrence of any stop string."""

from __future__ import annotations

from hypothesis import given, strategies as st

from dflash_trt.serving.openai.stop_strings import StopStrings


def _stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    matcher = StopStrings(stops)
    sent = []
    for piece in pieces:
        sent.append(matcher.feed(piece))
        if matcher.stopped:
            return "".join(sent), True
    return "".join(sent) + matcher.flush(), False


@given(st.lists(st.text(alphabet="ab. ", max_size=6), max_size=8),
       st.lists(st.text(alphabet="ab. ", min_size=1, max_size=3), max_size=3))
def test_text_ends_before_the_first_stop_string_however_it_is_chunked(pieces, stops):
    text = "".join(pieces)
    cuts = [text.find(s) for s in stops if s in text]
    sent, stopped = _stream(pieces, tuple(stops))
    assert stopped == bool(cuts)
    assert sent == (text[:min(cuts)] if cuts else text)


def test_a_held_prefix_is_sent_once_ruled_out():
    matcher = StopStrings(("END",))
    assert matcher.feed("the E") == "the "
    assert matcher.feed("N") == ""
    assert matcher.feed("d") == "ENd"
    assert not matcher.stopped
