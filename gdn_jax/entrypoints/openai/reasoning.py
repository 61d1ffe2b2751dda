"""The reasoning parser: a chat reply's think block apart from its content, as vLLM's "qwen3" parser splits them.

The reasoning runs to the first "</think>": from the reply's start when the rendered prompt left a block open, or after
a "<think>" the reply starts with. A stream holds back a possible tag's first characters, so that it never sends a
tag's characters.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves a think block open, so that the reply starts inside its reasoning
    (Qwen3.5's template with thinking on ends with "<think>\\n"; with `enable_thinking` false it closes the block)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


def split_reasoning(text: str, opened: bool, finished: bool) -> tuple[str | None, str | None]:
    """A chat reply's text -> (reasoning, content), None for a part it has not (or not yet) got. The reasoning runs
    to the first "</think>": from the reply's start if the prompt opened the block (`opened`), else if the reply
    opens it itself (an older template: the reply starts with "<think>", which is left out, as is one a reply to a
    prompt that opened the block starts with); a reply without a think block is all content. While not
    `finished`, text that may still become a tag (a start of "<think>" at the reply's start, a start of "</think>"
    at the reasoning's end) is held back, so that a stream never sends a tag's characters."""
    if text.startswith(THINK_START):  # a reply that opens the block itself (or, after a prompt that did, again)
        text, opened = text[len(THINK_START):], True
    elif not finished and text and THINK_START.startswith(text):
        return ("" if opened else None), None
    elif not opened:
        return None, text
    reasoning, end, content = text.partition(THINK_END)
    if end:
        return reasoning, content or None
    if not finished:
        held = next((n for n in range(min(len(THINK_END) - 1, len(reasoning)), 0, -1)
                     if THINK_END.startswith(reasoning[-n:])), 0)
        reasoning = reasoning[:len(reasoning) - held]
    return reasoning, None


class ReasoningStream:
    """What a stream has sent of a reply's reasoning and content (`split_reasoning` of the text sent so far)."""

    def __init__(self, opened: bool):
        self.opened, self.reasoning, self.content = opened, "", ""

    def advance(self, text: str, finished: bool) -> dict:
        """The reply's text sent so far -> the delta fields not sent yet ("reasoning", "content")."""
        reasoning, content = split_reasoning(text, self.opened, finished)
        out = {}
        for name, now in (("reasoning", reasoning or ""), ("content", content or "")):
            new = now[len(getattr(self, name)):]
            if new:
                out[name] = new
                setattr(self, name, now)
        return out
