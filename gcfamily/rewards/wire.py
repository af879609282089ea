"""The trainer's end of the reward worker's pipe, which never blocks: whatever the worker writes into it, or does not read.

The worker's own end of the pipe is a descriptor of the process the user's reward runs in, so a reward can write into
it (one wrote into descriptors 3-19 and a length header of 2 GB: `Connection.recv` then waited for bytes that never
came, past reward_timeout and through SIGTERM). Here the trainer's end is non-blocking; a message (multiprocessing's
framing: a 4-byte big-endian length, -1 then 8 bytes for a long one, then a pickle) is assembled from what arrives
between polls, so the caller keeps its deadline and its stop flag. A reply is plain values (tuples, lists, dicts,
strings, numbers, None): the unpickler builds nothing else, and a reply past MAX_REPLY bytes or that is not a pickle
of plain values is `Garbled`, which the caller treats as a lost worker.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import struct
from typing import Any, Optional

MAX_REPLY = 1 << 28
"""Bytes one reply may take: a call's values and error texts are far smaller."""


class Garbled(Exception):
    """The worker's pipe held something that is not a reply."""


class _PlainValues(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a reply holds only plain values, not {module}.{name}")


class Wire:
    """Messages over a socket descriptor, read and written a piece at a time so that neither side can hold the other."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()
        os.set_blocking(fd, False)

    def send(self, message: Any, wait_s: float) -> bool:
        """Write a message, waiting at most `wait_s` seconds for the worker to read; False when it did not."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = struct.pack("!i", len(data)) if len(data) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
        view = memoryview(head + data)
        while view:
            if not select.select([], [self.fd], [], wait_s)[1]:
                return False
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                continue
        return True

    def receive(self, wait_s: float) -> Optional[Any]:
        """The next whole message, waiting at most `wait_s` seconds for more bytes; None when it has not all come.
        EOFError when the worker's end closed; Garbled when what came is not a reply."""
        message = self._take()
        if message is not None or not select.select([self.fd], [], [], wait_s)[0]:
            return message
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return None
        except OSError as e:
            raise EOFError(str(e)) from e
        if not data:
            raise EOFError("the worker's end of the pipe closed")
        self.buffer += data
        return self._take()

    def _take(self) -> Optional[Any]:
        if len(self.buffer) < 4:
            return None
        (size,) = struct.unpack("!i", self.buffer[:4])
        start = 4
        if size == -1:
            if len(self.buffer) < 12:
                return None
            (size,), start = struct.unpack("!Q", self.buffer[4:12]), 12
        if not 0 <= size <= MAX_REPLY:
            raise Garbled(f"a reply said to be {size} bytes long")
        if len(self.buffer) < start + size:
            return None
        data = bytes(self.buffer[start : start + size])
        del self.buffer[: start + size]
        try:
            return _PlainValues(io.BytesIO(data)).load()
        except Exception as e:  # any garbage: a truncated pickle, an unknown opcode, a class
            raise Garbled(f"a reply that could not be read ({type(e).__name__})") from e
