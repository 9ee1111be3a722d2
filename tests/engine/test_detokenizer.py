"""IncrementalDetokenizer: token-by-token text equals a full decode; stop strings are found and cut exactly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer

MIXED = "héllo wörld — 你好，世界 🙂"
TEXTS = [
    MIXED,
    "emoji 🙂🙂 and ünïcödé text",
    "日本語のテキスト、そして한국어",
    "plain ascii,\n  with newlines\tand tabs ",
    "€100 ≠ ¥100 ≈ £80 … «quotes» 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer(str(tokenizer_dir))


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _feed(tok: Tokenizer, ids: list[int], prompt: list[int], params: SamplingParams):
    """Feed `ids` one at a time; return the detokenizer, the step at which a stop string hit (or None),
    the hit, and the text after every step."""
    det = IncrementalDetokenizer(tok.backend, prompt, params)
    texts = []
    for i, t in enumerate(ids):
        hit = det.update(t)
        texts.append(det.text)
        if hit is not None:
            return det, i, hit, texts
    return det, None, None, texts


def _first_step_containing(tok: Tokenizer, ids: list[int], s: str) -> int:
    """Index of the token whose decode first makes the text contain `s` (computed by full decodes)."""
    for j in range(1, len(ids) + 1):
        if s in tok.decode(ids[:j]):
            return j - 1
    raise AssertionError(f"{s!r} never appears")


def test_mixed_text_really_splits_characters_across_tokens(tok):
    # Guard: the tokenizer is byte-level and splits multi-byte characters, so the tests below mean something.
    ids = _encode(tok, MIXED)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    assert tok.decode(ids) == MIXED


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "Say:", "héllo ", "a " * 20])
def test_token_by_token_equals_full_decode(tok, text, prompt_text):
    ids = _encode(tok, text)
    prompt = _encode(tok, prompt_text)
    det, step, hit, texts = _feed(tok, ids, prompt, SamplingParams())
    assert hit is None and step is None
    assert det.text == tok.decode(ids) == text
    # Text only grows, never shows a half character, and after each token is a prefix of the final text.
    for t in texts:
        assert text.startswith(t)
        assert "\ufffd" not in t
    assert det.visible_text(finished=False) == text  # nothing held back without stop strings


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.sampled_from(list("aé ö—你好，界🙂\nxyz€€👩")), min_size=1, max_size=24).map("".join),
    st.lists(st.sampled_from(list("ab ü你🙂")), max_size=8).map("".join),
)
def test_token_by_token_equals_full_decode_random(tok, text, prompt_text):
    ids = _encode(tok, text)
    det, _, _, texts = _feed(tok, ids, _encode(tok, prompt_text), SamplingParams())
    assert det.text == tok.decode(ids) == text
    assert all(text.startswith(t) for t in texts)


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.eos_token_id
    ids = [*_encode(tok, "héllo"), eos, *_encode(tok, " wörld")]
    det, *_ = _feed(tok, ids, [1], SamplingParams())
    assert det.text == tok.decode(ids, skip_special_tokens=True) == "héllo wörld"
    det, *_ = _feed(tok, ids, [1], SamplingParams(skip_special_tokens=False))
    assert det.text == tok.decode(ids, skip_special_tokens=False) == "héllo</s> wörld"


def test_unfinished_character_at_end_is_rendered_like_decode(tok):
    # Output ends in the middle of a multi-byte character: flushing renders the stray bytes as decode does.
    ids = _encode(tok, "wörld 🙂")[:-1]
    assert tok.decode(ids).endswith("\ufffd")
    det, *_ = _feed(tok, ids, [], SamplingParams())
    det.flush()
    assert det.text == tok.decode(ids)


@pytest.mark.parametrize(
    "stop",
    [
        "wörld",  # spans several tokens, one character split over two
        "ö",  # a single character whose two bytes are two tokens
        "界 🙂",  # ends on the last byte of a 4-byte emoji
        "— 你",
        "llo w",
        "h",  # the very first character
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_exactly(tok, stop, include):
    ids = _encode(tok, MIXED)
    pos = MIXED.index(stop)
    expect_step = _first_step_containing(tok, ids, stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    det, step, hit, _ = _feed(tok, ids, _encode(tok, "Say:"), params)
    assert hit == stop
    assert step == expect_step
    assert det.text == (MIXED[: pos + len(stop)] if include else MIXED[:pos])
    assert det.visible_text(finished=True) == det.text


def test_stop_string_spanning_tokens_is_really_split(tok):
    ids = _encode(tok, MIXED)
    # "wörld" needs more than one token to complete: it is not in any single token's text.
    assert not any("wörld" in tok.decode([t]) for t in ids)
    assert not any("ö" in tok.decode([t]) for t in ids)


def test_earliest_of_several_stops_wins(tok):
    ids = _encode(tok, MIXED)
    # "wö" completes first; "ld" later.
    det, _, hit, _ = _feed(tok, ids, [], SamplingParams(stop=["ld", "wö"]))
    assert hit == "wö" and det.text == "héllo "
    # Both complete on the same token ("ld"): the one starting earlier cuts.
    det, _, hit, _ = _feed(tok, ids, [], SamplingParams(stop=["rld", "wörld"]))
    assert hit == "wörld" and det.text == "héllo "


def test_stop_string_only_in_prompt_or_across_prompt_boundary_does_not_fire(tok):
    prompt = _encode(tok, "héllo w")
    ids = _encode(tok, "örld and more")
    det, step, hit, _ = _feed(tok, ids, prompt, SamplingParams(stop=["héllo", "wör", "zzz"]))
    assert hit is None and step is None
    assert det.text == "örld and more"


def test_no_stop_string_present(tok):
    ids = _encode(tok, MIXED)
    det, step, hit, _ = _feed(tok, ids, [], SamplingParams(stop=["wörlds", "🙂🙂", "xyz"]))
    assert hit is None and step is None
    assert det.text == MIXED


def test_min_tokens_defers_stop_strings(tok):
    # As in vLLM: a stop string in the text of the first min_tokens tokens does not count.
    ids = _encode(tok, "abc abc abc")
    first = _first_step_containing(tok, ids, "abc")
    det, step, hit, _ = _feed(tok, ids, [], SamplingParams(stop=["abc"], min_tokens=first + 1))
    assert hit == "abc"
    assert step > first
    assert det.text == "abc "
    det, step, hit, _ = _feed(tok, ids, [], SamplingParams(stop=["abc"], min_tokens=0))
    assert (step, hit, det.text) == (first, "abc", "")


def test_visible_text_holds_back_possible_stop_prefix(tok):
    text = "héllo wörld — 你好，世界 🙂"
    ids = _encode(tok, text)
    stop = "世界 🙂!"  # never completes, but each growing prefix of it appears at the end
    hold = len(stop) - 1
    det = IncrementalDetokenizer(tok.backend, [], SamplingParams(stop=[stop, "xy"]))
    shown = ""
    saw_partial = False
    for t in ids:
        assert det.update(t) is None
        visible = det.visible_text(finished=False)
        # What is shown only grows, is a prefix of the text, and holds back at most `hold` characters.
        assert visible.startswith(shown)
        assert det.text.startswith(visible)
        assert len(det.text) - len(visible) == min(hold, len(det.text))
        # A tail of the text that could grow into the stop string is entirely held back.
        for i in range(1, len(stop)):
            if det.text.endswith(stop[:i]):
                saw_partial = True
                assert len(det.text) - len(visible) >= i
        shown = visible
    assert saw_partial
    assert det.text == text
    assert det.visible_text(finished=False) == text[: len(text) - hold]
    assert det.visible_text(finished=True) == text


def test_visible_text_never_shows_a_stop_string_that_later_completes(tok):
    ids = _encode(tok, MIXED)
    stop = "你好，世"
    det = IncrementalDetokenizer(tok.backend, [], SamplingParams(stop=[stop]))
    for t in ids:
        hit = det.update(t)
        if hit is not None:
            break
        assert not det.visible_text(finished=False).endswith("你")
        assert "你好" not in det.visible_text(finished=False)
    assert hit == stop
    assert det.visible_text(finished=True) == MIXED[: MIXED.index(stop)]
