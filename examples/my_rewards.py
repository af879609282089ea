"""Reward functions as TRL writes them: keyword arguments, one float (or None) per completion."""


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions near 20 characters score highest."""
    return [-abs(20 - len(completion)) for completion in completions]


def conversational_len(completions, **kwargs):
    """The same for conversational rows, where each completion is a list of messages."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]
