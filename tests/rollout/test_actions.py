"""The reply parser: what the model wrote -> (action, valid, key, reason), for any string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.rollout.actions import (
    DEFAULT_MAX_ACTION_CHARS,
    normalize_action_key,
    parse_reply,
    token_prefix_key,
)


def test_well_formed_reply():
    parsed = parse_reply("<think>the fridge is closed</think><action> open fridge 1 </action>")
    assert (parsed.action, parsed.valid, parsed.key, parsed.reason) == ("open fridge 1", True, "open fridge 1", "")


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("", "no_action_tag"),
        ("   ", "no_action_tag"),
        ("I will open the fridge.", "no_action_tag"),
        ("action: open fridge", "no_action_tag"),
        ("<action>open fridge", "unterminated_action"),
        ("<action></action>", "empty_action"),
        ("<action>  \n\t </action>", "empty_action"),
        ("<action>go west</action><action>go east</action>", "repeated_action_tag"),
        ("<action><action>go west</action></action>", "repeated_action_tag"),
        ("<action>go west</action> then <action>", "repeated_action_tag"),
    ],
)
def test_malformed_replies_are_invalid_with_a_reason(reply, reason):
    parsed = parse_reply(reply)
    assert not parsed.valid and parsed.reason == reason


def test_unterminated_tag_keeps_the_body_for_logging():
    parsed = parse_reply("<think>ok</think><action>  Go To Desk 1")
    assert parsed.action == "Go To Desk 1" and parsed.key == "go to desk 1" and not parsed.valid


def test_closing_tag_before_opening_tag_is_ignored():
    parsed = parse_reply("</action> noise <action>take key</action>")
    assert parsed.valid and parsed.action == "take key"


@pytest.mark.parametrize("reply", ["<ACTION>look</ACTION>", "<Action>look</aCtIoN>", "<action>look</ACTION>"])
def test_tags_match_case_insensitively(reply):
    parsed = parse_reply(reply)
    assert parsed.valid and parsed.action == "look"


def test_key_normalisation_folds_case_and_white_space():
    assert normalize_action_key("  Go \t to\nFridge   1 ") == "go to fridge 1"
    a = parse_reply("<action>Go  to Fridge 1</action>")
    b = parse_reply("<action>go to fridge 1</action>")
    assert a.key == b.key == "go to fridge 1" and a.action != b.action


def test_huge_reply_with_action_at_the_end():
    reply = "<think>" + "x" * 10_000 + "</think><action>inventory</action>"
    parsed = parse_reply(reply)
    assert parsed.valid and parsed.action == "inventory"


def test_action_longer_than_the_limit_is_invalid_and_cut():
    parsed = parse_reply("<action>" + "a" * 10_000 + "</action>")
    assert not parsed.valid and parsed.reason == "action_too_long"
    assert len(parsed.action) == DEFAULT_MAX_ACTION_CHARS
    assert parse_reply("<action>abcd</action>", max_action_chars=3).reason == "action_too_long"


def test_unicode_action_survives_and_keys_lowercase():
    parsed = parse_reply("<action>Öffne die Tür 1 ✓</action>")
    assert parsed.valid and parsed.action == "Öffne die Tür 1 ✓" and parsed.key == "öffne die tür 1 ✓"


def test_lone_surrogate_becomes_replacement_character():
    parsed = parse_reply("<action>take \ud800 key</action>")
    assert parsed.valid
    assert "\ud800" not in parsed.action
    parsed.action.encode("utf-8")  # a lone surrogate would raise here


@pytest.mark.parametrize("reply", [None, 42, b"<action>x</action>"])
def test_non_string_input_never_raises(reply):
    parsed = parse_reply(reply)
    assert isinstance(parsed.action, str) and isinstance(parsed.valid, bool)


@pytest.mark.parametrize(
    "reply, valid",
    [
        ("<think>plan</think><action>look</action>", True),
        ("<action>look</action><think>late</think>", False),
        ("<action>look</action>", False),
        ("<think>never closed <action>look</action>", False),
    ],
)
def test_require_think(reply, valid):
    parsed = parse_reply(reply, require_think=True)
    assert parsed.valid is valid
    assert parsed.reason == ("" if valid else "missing_think")


def test_token_prefix_key():
    assert token_prefix_key([5, 6, 7], 2) == (5, 6)
    assert token_prefix_key([5], 3) == (5,)
    with pytest.raises(ValueError, match="action_key_tokens=0"):
        token_prefix_key([1, 2], 0)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_parses_without_raising(reply):
    parsed = parse_reply(reply)
    parsed.action.encode("utf-8")
    assert parsed.key == normalize_action_key(parsed.action)
    assert parsed.valid == (parsed.reason == "")
    if parsed.valid:
        assert parsed.action and len(parsed.action) <= DEFAULT_MAX_ACTION_CHARS


_body = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<>"), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(_body, st.text(st.characters(blacklist_characters="<>"), max_size=50))
def test_wrapped_body_round_trips(body, prefix):
    parsed = parse_reply(f"{prefix}<action>{body}</action>")
    if body.strip():
        assert parsed.valid and parsed.action == body.strip()
    else:
        assert parsed.reason == "empty_action"
