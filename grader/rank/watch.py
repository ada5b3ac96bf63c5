"""Hangs judged from evidence, not from timeouts: a deadlock is named as soon as it is certain.

Every blocking wait on a collective or a send/recv goes through `Work.wait`. While an item runs, the
watch replaces it with a wait that polls the work and, between polls, reads where the other ranks of
the item's group are (each rank's progress file: the ledger writes "inside" a collective, this watch
"waiting" on one, the entry "finished" after the item). When every rank of the group is waiting or
has finished the item, and they are not all waiting on the same collective, no wait can ever
complete: that is a deadlock, and after the picture has held still for `STABLE_S` the waiting ranks
raise `Deadlock`, which names who waits where. The process-group timeout stays as the backstop (a
rank blocked where no Work is waited on, e.g. a functional collective).
"""
from __future__ import annotations

import json
import os
import time

import torch

STABLE_S = 1.0           # the same all-blocked picture this long means nothing is in flight
CHECK_EVERY_S = 0.05
P2P = ("send", "recv")


class Deadlock(BaseException):
    """Raised on a waiting rank; a BaseException so that student code's `except Exception` cannot swallow it."""


def _describe(r: int, state: dict) -> str:
    if state.get("where") == "waiting":
        return f"rank {r} waits in {state.get('op')} #{state.get('index')} ({state.get('phase')})"
    return f"rank {r} had finished this check"


class Watch:
    """One per rank process. `begin(item, group_ranks, ledger)` before an item, `end()` after it."""

    def __init__(self, outdir: str, job_rank: int):
        self.outdir, self.job_rank = outdir, job_rank
        self.item = None
        self.ranks: list[int] = []
        self.ledger = None
        work = torch._C._distributed_c10d.Work
        self._orig = work.wait
        watch = self

        def wait(w, *args, **kwargs):
            if watch.item is None or args or kwargs:      # outside an item, or the caller set its own timeout
                return watch._orig(w, *args, **kwargs)
            return watch._wait(w)

        work.wait = wait

    def progress_path(self, job_rank: int) -> str:
        return os.path.join(self.outdir, f"rank{job_rank}.progress")

    def begin(self, item_id: str, ranks: list[int], ledger):
        self.item, self.ranks, self.ledger = item_id, ranks, ledger

    def end(self):
        if self.item is not None:
            self._write({"item": self.item, "where": "finished"})
        self.item = None

    def _write(self, state: dict):
        path = self.progress_path(self.job_rank)
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def _read(self, job_rank: int) -> dict:
        try:
            with open(self.progress_path(job_rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _wait(self, work):
        if work.is_completed():
            return self._orig(work)
        last = self.ledger.entries[-1] if self.ledger is not None and self.ledger.entries else {}   # just issued
        self._write({"item": self.item, "where": "waiting", "op": last.get("op", "a collective"),
                     "index": last.get("index", "?"), "phase": getattr(self.ledger, "phase", "?")})
        delay, picture, since = 1e-4, None, 0.0
        next_check = time.monotonic() + CHECK_EVERY_S
        try:
            while not work.is_completed():
                time.sleep(delay)
                delay = min(2 * delay, 5e-3)
                now = time.monotonic()
                if now < next_check:
                    continue
                next_check = now + CHECK_EVERY_S
                seen = self._deadlock_picture()
                if seen is None or seen != picture:
                    picture, since = seen, now
                elif now - since >= STABLE_S:
                    raise Deadlock(self._message(seen))
        finally:
            self._write({"item": self.item, "where": "between collectives", "phase": getattr(self.ledger, "phase", "?")})
        return self._orig(work)

    def _deadlock_picture(self) -> tuple | None:
        """The group's states when no wait can complete (all waiting or finished, not all on one collective)."""
        states = []
        for r in self.ranks:
            s = self._read(r)
            finished = s.get("item") != self.item or s.get("where") in ("finished", "done")
            if not finished and s.get("where") != "waiting":
                return None                     # someone is still computing or issuing: not (yet) stuck
            states.append(("finished",) if finished else ("waiting", s.get("op"), s.get("index"), s.get("phase")))
        waits = {s for s in states if s[0] == "waiting"}
        if len(waits) == 1 and len(states) == len([s for s in states if s[0] == "waiting"]) \
                and next(iter(waits))[1] not in P2P:
            return None                         # all in the same collective: slow, not stuck
        return tuple(states)

    def _message(self, picture: tuple) -> str:
        parts = [_describe(i, {"where": s[0], "op": s[1], "index": s[2], "phase": s[3]} if s[0] == "waiting"
                           else {"where": "finished"}) for i, s in enumerate(picture)]
        waits = [s for s in picture if s[0] == "waiting"]
        if waits and all(s[1] in P2P for s in waits) and not any(s[0] == "finished" for s in picture):
            why = ("every rank waits for a message no peer is sending: post each send together with its "
                   "receive (dist.batch_isend_irecv, or isend before recv) so no rank blocks in its first one.")
        else:
            why = ("a rank that skips or adds a collective, or issues them in another order, leaves the "
                   "others waiting forever.")
        return "deadlock: " + "; ".join(parts) + ". " + why
