"""Warnings that point at the user's line, not the package's, from the caller's thread or from the package's threads."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable

PACKAGE = os.path.dirname(os.path.abspath(__file__))
# where a thread's stack starts: a frame of these is no user's line
THREAD_START = (os.path.abspath(threading.__file__),
                os.path.dirname(os.path.abspath(concurrent.futures.__file__)) + os.sep)


def user_stacklevel() -> int:
    """The `stacklevel` of a `warnings.warn` made by the caller of this function that names the first frame outside
    the package (the user's line), however many of the package's frames lie between (`LLM` builds an `LLMEngine`).
    On a thread whose stack holds no user frame (a thread pool's), the package's outermost frame instead: the call
    that began the package's work there, not the thread pool's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(THREAD_START):
        return max(level - 1, 1)
    return level


_held = threading.local()  # .warnings: on a thread of `map_on_threads`, what `warn` holds for its caller


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warns `message` at the user's line (`user_stacklevel`); on a thread of `map_on_threads`, later, on the thread
    that called it."""
    held = getattr(_held, "warnings", None)
    if held is not None:
        held.append((message, category))
    else:
        warnings.warn(message, category, stacklevel=user_stacklevel())


def map_on_threads(fn: Callable, items: Iterable, threads: int) -> list:
    """`[fn(item) for item in items]`, run on `threads` threads; what `fn` warns through `warn` is warned on this
    thread once they are done, in order, so that it points at the user's line (a thread's stack ends in the thread
    pool)."""
    def run(item):
        _held.warnings = []
        try:
            return fn(item), _held.warnings
        finally:
            _held.warnings = None

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(run, items))
    for _, held in done:
        for message, category in held:
            warn(message, category)
    return [result for result, _ in done]
