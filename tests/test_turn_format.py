import pytest

from qevolve.environments.turn_format import format_turn, parse_turn


@pytest.mark.parametrize("text, action", [
    ("Thought: the mug is on the desk.\nAction: go to desk 1", "go to desk 1"),
    ("  Thought: multi\nline thought\nAction:   take mug 1 from desk 1  \n", "take mug 1 from desk 1"),
    ("thought: lower case keys\naction: look", "look"),
])
def test_well_formed_thought_action(text, action):
    parsed = parse_turn(text, "thought_action")
    assert parsed.format_valid, parsed.error
    assert parsed.action == action
    assert parsed.thought


@pytest.mark.parametrize("text, action, error", [
    ("go to desk 1", None, "no 'Action:' line"),
    ("Thought: hmm\nAction:", None, "empty action"),
    ("Action: go to desk 1", "go to desk 1", "missing 'Thought:' before the action"),
    ("Thought: a\nAction: look\nAction: inventory", "look", "more than one 'Action:' line"),
    ("Thought: a\nAction: look\nObservation: you see", "look", "text after the action line"),
])
def test_malformed_thought_action(text, action, error):
    parsed = parse_turn(text, "thought_action")
    assert not parsed.format_valid
    assert parsed.action == action
    assert parsed.error == error


def test_action_only_format():
    assert parse_turn("Action: look", "action").format_valid
    assert parse_turn("Action: look", "action").action == "look"
    bad = parse_turn("I think\nAction: look", "action")
    assert not bad.format_valid and bad.action == "look"
    assert not parse_turn("look", "action").format_valid


def test_format_round_trip():
    for fmt in ("thought_action", "action"):
        text = format_turn("open drawer 1", "check the drawer", fmt)
        parsed = parse_turn(text, fmt)
        assert parsed.format_valid and parsed.action == "open drawer 1"
    with pytest.raises(ValueError, match="turn_format"):
        parse_turn("Action: x", "json")
    with pytest.raises(ValueError, match="one line"):
        format_turn("a\nb")
