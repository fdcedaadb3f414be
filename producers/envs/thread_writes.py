"""How many bytes the calling thread has written: Linux's per-thread I/O counter, read cheaply.

The text-to-SQL guard (``producers.envs.sql``) reads it from SQLite's progress handler to
bound what one query writes to SQLite's temporary files.  The counter
(``/proc/thread-self/io``, ``wchar``) counts every byte this thread passed to write and
pwrite, so it meters one connection exactly while that connection's query runs on the
thread (and SQLite's sorter runs no worker threads), whatever other threads do.  One read
costs a few microseconds: the file stays open and is read again from offset 0.
"""

from __future__ import annotations

import os
from pathlib import Path

_THREAD_IO = Path("/proc/thread-self/io")


class ThreadWrites:
    """Bytes the calling thread has written (write, pwrite) since ``start``, from Linux's per-thread counter."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._start = 0
        self._start = self.written()

    @classmethod
    def start(cls) -> ThreadWrites | None:
        """A meter for the calling thread, or None where the counter does not exist."""
        try:
            fd = os.open(_THREAD_IO, os.O_RDONLY)
        except OSError:
            return None
        try:
            return cls(fd)
        except (OSError, ValueError, IndexError):  # a counter file without wchar
            os.close(fd)
            return None

    def written(self) -> int:
        """Bytes written since the meter started."""
        text = os.pread(self._fd, 4096, 0)
        return int(text.split(b"wchar:", 1)[1].split(b"\n", 1)[0]) - self._start

    def close(self) -> None:
        """Release the counter file (a meter is used for one query)."""
        os.close(self._fd)
