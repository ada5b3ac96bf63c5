"""What a launcher prints, read line by line: rank output (prefixed `[rank r]`, capped), a torchrun rank's result
declaration, and the fork/warm launcher's closing `@@status` line."""
from __future__ import annotations

import json
import re
from typing import Callable

TORCHRUN_PREFIX = re.compile(r"^\[default(\d+)\]:")
MAX_OUTPUT_BYTES = 2_000_000     # a rank printing without end must not fill memory


class Relay:
    def __init__(self, stream: Callable[[str], None] | None = None):
        self.stream = stream
        self.lines: list[str] = []
        self.declared: dict[int, str] = {}
        self.status: dict = {}
        self._buf = b""
        self._seen = 0
        self._truncated = False

    def feed(self, chunk: bytes):
        """Bytes as they come; whole lines are handled, a partial one waits for the rest."""
        self._buf += chunk
        *done, self._buf = self._buf.split(b"\n")
        for raw in done:
            self.line(raw)

    def flush(self):
        for raw in self._buf.split(b"\n"):
            if raw:
                self.line(raw)
        self._buf = b""

    def line(self, raw: bytes):
        line = raw.decode("utf-8", "replace")
        if line.startswith("@@status "):
            try:
                self.status.update(json.loads(line[len("@@status "):]))
            except ValueError:
                pass
            return
        m = TORCHRUN_PREFIX.match(line)
        if m:
            line = f"[rank {m.group(1)}] " + line[m.end():]
            body = line.split("] ", 1)[1] if "] " in line else ""
            if body.startswith("@@result "):     # a torchrun rank's result file and its digest (fork and warm
                # ranks hand their results to the launcher's switchboard instead)
                self.declared[int(m.group(1))] = body[len("@@result "):].strip()
                return
        self._seen += len(raw)
        if self._seen > MAX_OUTPUT_BYTES:
            if not self._truncated:
                self._truncated = True
                self.lines.append("[launch] output truncated after 2 MB")
            return
        self.lines.append(line)
        if self.stream:
            self.stream(line)
