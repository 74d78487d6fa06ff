"""Rehearsal: the policy playing the environment.

Training-time helpers (used by rollout.py while the policy writes a tool's response, role WORLD):
`world_stop_text`, `parse_rehearsal` and `validate_rehearsal`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# Kinds of defect a rehearsed response can have; train.py may penalise each by a configurable amount.
REHEARSAL_DEFECTS = ("empty", "unterminated", "invalid_json")


def world_stop_text(obs_end: str) -> str:
    """The tag that ends a rehearsed response: the template's closing text, e.g. '</tool_response>'."""
    return obs_end.strip()


@dataclass
class RehearsalCheck:
    text: str                     # the rehearsed observation, closing tag removed
    defects: list[str] = field(default_factory=list)


def parse_rehearsal(generated: str, obs_end: str, terminated: bool, expect_json: bool = True) -> RehearsalCheck:
    """Turn the WORLD tokens' text into an observation and name its defects.

    `terminated` is whether generation stopped on the closing tag (not on EOS or the token limit). Tools in
    our benchmarks answer JSON; `expect_json=False` for tools that return plain text.
    """
    stop = world_stop_text(obs_end)
    text = generated
    if terminated and text.endswith(stop):
        text = text[: -len(stop)]
        head = obs_end[: obs_end.find(stop)]  # the whitespace the template puts before the tag
        if head and text.endswith(head):
            text = text[: -len(head)]
    return RehearsalCheck(text=text, defects=validate_rehearsal(text, terminated, expect_json))


def validate_rehearsal(text: str, terminated: bool, expect_json: bool = True) -> list[str]:
    defects = []
    if not terminated:
        defects.append("unterminated")
    if not text.strip():
        defects.append("empty")
    elif expect_json:
        try:
            json.loads(text)
        except ValueError:
            defects.append("invalid_json")
    return defects
