"""The text of one agent turn and its parser.

Two formats, chosen per config (``turn_format``):

* ``thought_action`` (ReAct):   ``Thought: <free text>\\nAction: <action>``
* ``action``:                   ``Action: <action>``

The parser returns the action plus a format-validity flag. A turn is well-formed when it contains
exactly one ``Action:`` line with a non-empty single-line action, and, in ``thought_action`` format,
a ``Thought:`` that precedes it. Surrounding whitespace is tolerated; anything after the action line
is not (a model that keeps talking after its action is making a format error worth penalising).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

TurnFormat = Literal["thought_action", "action"]
TURN_FORMATS: tuple[str, ...] = ("thought_action", "action")

_ACTION_RE = re.compile(r"^\s*Action\s*:\s*(.*?)\s*$", re.IGNORECASE)
_THOUGHT_RE = re.compile(r"^\s*Thought\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class ParsedTurn:
    action: str | None  # None when no action could be read at all
    thought: str | None
    format_valid: bool
    error: str | None = None  # why the format is invalid


def format_turn(action: str, thought: str | None = None, turn_format: str = "thought_action") -> str:
    """The canonical text of an agent turn (used for expert demonstrations)."""
    if turn_format not in TURN_FORMATS:
        raise ValueError(f"turn_format {turn_format!r}: expected one of {TURN_FORMATS}")
    if "\n" in action:
        raise ValueError(f"action must be one line, got {action!r}")
    if turn_format == "thought_action":
        return f"Thought: {(thought or '').strip()}\nAction: {action.strip()}"
    return f"Action: {action.strip()}"


def parse_turn(text: str, turn_format: str = "thought_action") -> ParsedTurn:
    """Parse an agent turn; always returns the best-guess action when one exists.

    Even when the format is invalid (say, a missing thought), a readable action is still returned so
    the config may choose to execute it; the flag records the format error either way.
    """
    if turn_format not in TURN_FORMATS:
        raise ValueError(f"turn_format {turn_format!r}: expected one of {TURN_FORMATS}")
    lines = text.strip().splitlines()
    action_rows = [i for i, line in enumerate(lines) if _ACTION_RE.match(line)]
    if not action_rows:
        return ParsedTurn(None, None, False, "no 'Action:' line")
    first = action_rows[0]
    action = _ACTION_RE.match(lines[first]).group(1).strip()  # type: ignore[union-attr]
    thought_lines = lines[:first]
    thought = None
    if thought_lines and _THOUGHT_RE.match(thought_lines[0]):
        thought = re.sub(r"^\s*Thought\s*:\s*", "", "\n".join(thought_lines), flags=re.IGNORECASE).strip()
    if not action:
        return ParsedTurn(None, thought, False, "empty action")
    if len(action_rows) > 1:
        return ParsedTurn(action, thought, False, "more than one 'Action:' line")
    if any(line.strip() for line in lines[first + 1:]):
        return ParsedTurn(action, thought, False, "text after the action line")
    if turn_format == "thought_action":
        if thought is None:
            return ParsedTurn(action, None, False, "missing 'Thought:' before the action")
    elif any(line.strip() for line in thought_lines):
        return ParsedTurn(action, None, False, "text before the action line")
    return ParsedTurn(action, thought, True, None)
