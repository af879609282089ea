"""A time bound on pure-Python work that cannot bound itself (a chat template's loops): `within(seconds)`.

Jinja's sandbox caps each `range` at 100,000 items but not their product, so two nested loops render for ever. One
watcher thread serves every bounded block: when a block's deadline passes it raises `Overtime` in the thread running
it (CPython's PyThreadState_SetAsyncExc), which stops the next bytecode, in any thread, where a signal could only stop
the main one. A single C call (one huge string operation) is not interrupted until it returns.

    with within(10.0) as timer:
        text = template.render(...)
    # Overtime raised inside the block when it ran past 10 s
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Overtime(Exception):
    """Raised inside a `within` block that ran past its deadline."""


_lock = threading.Condition()
_armed: dict[int, int] = {}  # block id -> thread id of the blocks still running
_queue: list[tuple[float, int]] = []  # (deadline, block id), a heap
_ids = itertools.count()
_watcher: list[threading.Thread] = []


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _watch() -> None:
    with _lock:
        while True:
            now = time.monotonic()
            while _queue and (_queue[0][1] not in _armed or _queue[0][0] <= now):
                _, block = heapq.heappop(_queue)
                thread_id = _armed.pop(block, None)
                if thread_id is not None:  # past its deadline and still running
                    _raise_in(thread_id, Overtime)
            _lock.wait(None if not _queue else _queue[0][0] - now)


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Run the block with a deadline `seconds` from now; Overtime is raised in it when the deadline passes."""
    block, me = next(_ids), threading.get_ident()
    with _lock:
        if not _watcher:
            _watcher.append(threading.Thread(target=_watch, name="gcf-deadline", daemon=True))
            _watcher[0].start()
        _armed[block] = me
        heapq.heappush(_queue, (time.monotonic() + seconds, block))
        _lock.notify()
    try:
        yield
    finally:
        with _lock:
            fired = _armed.pop(block, None) is None
            if fired:  # raised in this thread but maybe not delivered yet: take it back and raise it here instead
                _raise_in(me, None)
        if fired:
            raise Overtime(f"did not finish within {seconds:g} s")
