"""The one action normaliser every env gives its engine commands through."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from envs import TinyEnv, normalise_action
from envs.webshop import _normalize_action as webshop_action

# White space Python folds beyond the ASCII kind, and letters whose lower case depends on
# their neighbours (a final sigma) or changes their length (dotted capital I).
TRICKY = st.text(alphabet=st.sampled_from(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2003\u2028\u3000aZΣΑİß[]"), max_size=12)


def test_white_space_is_folded_and_case_lowered_unless_kept():
    assert normalise_action("  Get 1\tOak  LOG\n") == "get 1 oak log"
    assert normalise_action("  Open Door\n to  Kitchen ", lower=False) == "Open Door to Kitchen"
    assert normalise_action(None) == "none" and normalise_action("") == ""


@given(st.one_of(st.text(), TRICKY))
def test_lowering_before_or_after_folding_gives_the_same_command(text):
    # ALFWorld and TinyEnv lower-cased before folding, TextCraft after: one function keeps both.
    assert normalise_action(text) == " ".join(text.lower().split()) == " ".join(text.split()).lower()
    assert normalise_action(text, lower=False) == " ".join(text.split())


def test_envs_take_commands_with_stray_spacing_and_capitals():
    env = TinyEnv()
    env.reset(2)  # start 0, goal 3
    assert env.step("  RIGHT\n").observation.startswith("You moved right.")
    # WebShop lower-cases the action name only: the argument is matched as written.
    assert webshop_action("  Click [ Buy  Now ] ") == "click[Buy Now]"
    assert webshop_action(" SEARCH[ Red   Shoes ]") == "search[Red Shoes]"
