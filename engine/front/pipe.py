"""Length-prefixed pickle frames over a pipe's file descriptors, correct whether they block or not.

An event loop may put a descriptor it watches in non-blocking mode (uvloop's ``add_reader`` does), where a
read returns what has arrived so far and a write takes what the pipe has room for. ``FrameReader`` keeps
a partial frame until the rest arrives, and ``FrameWriter`` keeps what the pipe could not take, so a
message is never lost or cut whatever the descriptor's mode.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
MAX_FRAME_BYTES = 1 << 30  # a longer announced frame means the stream is corrupt
_READ_BYTES = 1 << 20
PIPE_BYTES = 1 << 20  # asked of the kernel per pipe (Linux's default is 64 KiB): fewer wake-ups


def encode(message: Any) -> bytes:
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def enlarge(fd: int) -> None:
    """Ask for a larger pipe buffer where the platform allows it (best effort)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        pass


class FrameReader:
    """Messages out of a descriptor's byte stream."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def read_available(self) -> tuple[list[Any], bool]:
        """Every complete message that can be read without waiting, and whether the writer is gone.

        On a blocking descriptor, call it only when a read will not block (the descriptor polled
        readable): it reads once. On a non-blocking one it reads until nothing more has arrived.
        """
        is_eof = False
        while True:
            try:
                chunk = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                is_eof = True
                break
            self._buf += chunk
            if len(chunk) < _READ_BYTES or os.get_blocking(self.fd):
                break
        return self._take_frames(), is_eof

    def read_one(self) -> Any:
        """The next message, waiting for it (a blocking descriptor). Raises ``EOFError`` at the end."""
        while True:
            frames = self._take_frames(limit=1)
            if frames:
                return frames[0]
            chunk = os.read(self.fd, _READ_BYTES)
            if not chunk:
                raise EOFError("the pipe's writer is gone")
            self._buf += chunk

    def _take_frames(self, limit: int = 0) -> list[Any]:
        frames, start, buf = [], 0, self._buf
        while len(buf) - start >= _HEADER.size and (not limit or len(frames) < limit):
            (size,) = _HEADER.unpack_from(buf, start)
            if size > MAX_FRAME_BYTES:
                raise OSError(f"corrupt frame on the engine pipe ({size} bytes announced)")
            end = start + _HEADER.size + size
            if len(buf) < end:
                break
            frames.append(pickle.loads(memoryview(buf)[start + _HEADER.size:end]))
            start = end
        if start:
            del buf[:start]
        return frames


class FrameWriter:
    """Messages into a descriptor. On a non-blocking one, what the pipe cannot take now waits in
    ``pending`` (in order) until ``flush``; on a blocking one ``write`` returns once all is out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = bytearray()

    def write(self, message: Any) -> bool:
        """Queue ``message`` and write what the pipe takes; whether nothing is left pending."""
        data = encode(message)
        if self.pending:
            self.pending += data
            return False
        self.pending = bytearray(data)
        return self.flush()

    def flush(self) -> bool:
        """Write pending bytes until done or the pipe is full; whether nothing is left pending."""
        view = memoryview(self.pending)
        sent = 0
        try:
            while sent < len(view):
                sent += os.write(self.fd, view[sent:])
        except BlockingIOError:
            pass
        finally:
            view.release()
            del self.pending[:sent]
        return not self.pending
