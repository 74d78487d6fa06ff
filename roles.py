"""The role of each token of a rollout: the only record of who wrote it, and so of what each loss trains."""
from enum import IntEnum


class Role(IntEnum):
    """A token's role: PAD, PROMPT (prompt, scaffolding, user turns), ACT (sampled assistant tokens), WORLD (a
    tool response the policy rehearsed) or OBS (a real tool response); stored as ints in Rollout.roles."""
    PAD = 0
    PROMPT = 1
    ACT = 2
    WORLD = 3
    OBS = 4
