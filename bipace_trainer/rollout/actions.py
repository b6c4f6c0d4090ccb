"""From a model reply to an env action, a validity flag and an action key.

The agent answers in the GiGPO format::

    <think> ...reasoning... </think><action> go to fridge 1 </action>

`parse_reply` is deterministic and never raises. Its rules, in order:

1. Text is made valid unicode (lone surrogates and other unencodable code points
   become U+FFFD), so any `str` is accepted.
2. The action is the body between the first ``<action>`` and the first ``</action>``
   after it (tags are matched case-insensitively).
3. The reply is *invalid* (and later penalised, docs/concepts/math.md#step-returns) when: there is no complete
   ``<action>…</action>`` pair; there is more than one ``<action>`` opening tag
   (repeated or nested tags); the body is empty after stripping; the body is longer
   than `max_action_chars`; or `require_think` is set and there is no
   ``<think>…</think>`` block before the action.
4. An invalid reply still yields a harmless action for the env: the caller sends the
   env's `invalid_action` (e.g. "look"), so a malformed reply never crashes an engine.

The action key (docs/concepts/math.md#step-records) is the body lower-cased with white space folded to single
spaces, so "Go  to Fridge 1" and "go to fridge 1" count as the same action. An
alternative key, the first k completion token ids, is `token_prefix_key`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ParsedReply", "parse_reply", "normalize_action_key", "token_prefix_key"]

_OPEN = re.compile(r"<action>", re.IGNORECASE)
_CLOSE = re.compile(r"</action>", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)

DEFAULT_MAX_ACTION_CHARS = 256


@dataclass(frozen=True)
class ParsedReply:
    """Result of parsing one reply.

    Attributes:
        action: the action body, stripped ("" when none was found).
        valid: the reply had exactly one well-formed, non-empty action.
        key: normalised action key (lower-case, white space folded); "" when invalid
            and no body was found.
        reason: why the reply is invalid ("" when valid); one of "no_action_tag",
            "unterminated_action", "repeated_action_tag", "empty_action",
            "action_too_long", "missing_think".
    """

    action: str
    valid: bool
    key: str
    reason: str = ""


def _clean_unicode(text: str) -> str:
    return text.encode("utf-8", errors="replace").decode("utf-8", errors="replace")


def normalize_action_key(action: str) -> str:
    """Lower-case, fold every run of white space to one space, strip the ends."""
    return " ".join(action.lower().split())


def token_prefix_key(completion_ids, k: int) -> tuple[int, ...]:
    """Action key from the first `k` completion token ids (an alternative to the normalised body)."""
    if k <= 0:
        raise ValueError(f"action_key_tokens={k} must be positive; set it to the number of leading tokens to key on.")
    return tuple(int(i) for i in list(completion_ids)[:k])


def parse_reply(
    reply: str,
    *,
    require_think: bool = False,
    max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
) -> ParsedReply:
    """Parse a model reply into (action, valid, key, reason). Never raises.

    Args:
        reply: the decoded completion. Non-`str` input is converted with `str()`.
        require_think: also require a ``<think>…</think>`` block before the action.
        max_action_chars: bodies longer than this are invalid (and truncated).
    """
    if not isinstance(reply, str):
        reply = "" if reply is None else str(reply)
    text = _clean_unicode(reply)

    opens = list(_OPEN.finditer(text))
    if not opens:
        return ParsedReply(action="", valid=False, key="", reason="no_action_tag")
    first = opens[0]
    close = _CLOSE.search(text, first.end())
    if close is None:
        body = text[first.end() :].strip()[:max_action_chars]
        return ParsedReply(action=body, valid=False, key=normalize_action_key(body), reason="unterminated_action")

    body = text[first.end() : close.start()].strip()
    reason = ""
    if len(opens) > 1:
        reason = "repeated_action_tag"
    elif not body:
        reason = "empty_action"
    elif len(body) > max_action_chars:
        reason = "action_too_long"
    elif require_think and not _THINK.search(text, 0, first.start()):
        reason = "missing_think"
    if len(body) > max_action_chars:
        body = body[:max_action_chars]
    return ParsedReply(action=body, valid=not reason, key=normalize_action_key(body), reason=reason)
