"""Where a rank is, in a small file that others read while it runs, rewritten in place.

A grading rank updates its progress before and after every collective (`tpkit.ledger.CommLedger`) and
while it waits on one (the grader's deadlock watch); its peers read it to judge a hang, the grader to say
where each rank was. One update is one pwrite(): writing a temporary file and renaming it costs about
1 ms on an overlay filesystem, several times per collective. A reader can catch a write half done, so
it retries; a shorter state is padded with spaces over the longer one before it.
"""
from __future__ import annotations

import json
import os
import stat


class UnsafeFile(OSError):
    """A path another process controls is not a regular file, or is too large to read."""


def read_regular(path: str, limit: int) -> bytes | None:
    """The bytes of `path`, never blocking and never following a link: None if it does not exist;
    UnsafeFile if it is a FIFO, socket, device, symlink or directory, or is larger than `limit` bytes.
    For files written by a process the reader does not trust (a FIFO would block a plain open() forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:      # ELOOP: a symlink
        raise UnsafeFile(f"{os.path.basename(path)} is not a regular file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{os.path.basename(path)} is not a regular file")
        if st.st_size > limit:
            raise UnsafeFile(f"{os.path.basename(path)} is {st.st_size} bytes, over the {limit}-byte limit")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:      # grew while being read
            raise UnsafeFile(f"{os.path.basename(path)} is over the {limit}-byte limit")
        return data
    finally:
        os.close(fd)


class ProgressFile:
    """The one writer of a progress file in this process (the ledger and the watch share it)."""

    _open: dict[str, "ProgressFile"] = {}

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.size = 0

    @classmethod
    def at(cls, path: str) -> "ProgressFile":
        if path not in cls._open:
            cls._open[path] = cls(path)
        return cls._open[path]

    def write(self, state: dict):
        data = json.dumps(state).encode()
        os.pwrite(self.fd, data.ljust(self.size), 0)
        self.size = max(self.size, len(data))


def read_progress(path: str, tries: int = 3) -> dict:
    """The state last written to `path`; {} if there is none (yet)."""
    for _ in range(tries):
        try:
            data = read_regular(path, 1 << 16)    # a peer's file: it may be a FIFO or huge
        except OSError:
            return {}
        try:
            state = json.loads(data) if data and data.strip() else {}
        except ValueError:      # caught mid-write: read again
            continue
        return state if isinstance(state, dict) else {}
    return {}
