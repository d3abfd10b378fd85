"""Stop strings across arbitrary text splits (the front end sees detokenized pieces)."""

from __future__ import annotations

from blink_appliance.frontend.stop_strings import StopStringMatcher
from hypothesis import example, given
from hypothesis import strategies as st


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if not m.stopped:
        out += m.flush()
    return out, m.stopped


def _reference(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Generation stops after the first piece at which any stop string has appeared, cut at the
    earliest occurrence so far. Not a search of the whole text: what follows the stop is never
    generated, so with stops "a" and ".aa" the stream ".a" + "a" ends at "." ("a" came first)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_stop_inside_one_piece_and_across_pieces():
    assert _run(["\n\n"], ["Hello", " world\n", "\nmore"]) == ("Hello world", True)
    assert _run(["END"], ["abcE", "N", "Dxyz"]) == ("abc", True)
    assert _run(["END"], ["abcE", "N", "d"]) == ("abcENd", False)
    assert _run([], ["a", "b"]) == ("ab", False)


def test_held_text_is_released_once_it_cannot_start_a_stop():
    m = StopStringMatcher(["abc"])
    assert m.feed("xxab") == "xx"  # "ab" may begin "abc"
    assert m.feed("x") == "abx"
    assert m.flush() == ""


def test_nothing_after_stop():
    m = StopStringMatcher(["."])
    assert m.feed("one. two") == "one"
    assert m.stopped
    assert m.feed("three") == "" and m.flush() == ""


@given(
    stops=st.lists(st.text("ab.", min_size=1, max_size=3), min_size=1, max_size=3),
    text=st.text("ab.c", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
@example(stops=["a", ".aa"], text=".aa", cuts=[2])  # a CI run found it: an earlier stop completes later
@example(stops=["a", ".aa"], text=".aa", cuts=[])
def test_matches_a_search_after_each_piece_for_any_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _run(stops, pieces) == _reference(stops, pieces)
