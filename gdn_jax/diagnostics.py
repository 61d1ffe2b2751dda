"""Warnings that point at the user's line, not the package's."""

from __future__ import annotations

import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The `stacklevel` of a `warnings.warn` made by the caller of this function that names the first frame outside
    the package (the user's line), however many of the package's frames lie between (`LLM` builds an `LLMEngine`)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level
