"""Hangs judged from evidence, not from timeouts, where ranks talk gloo or NCCL to each other (torchrun): a deadlock
is named as soon as it is certain. (The fork and warm launchers' switchboard judges its own: launch/switchboard.py.)

Every blocking wait on a collective or a send/recv goes through `Work.wait`. While an item runs, the
watch replaces it with a wait that polls the work and, between polls, reads where the other ranks of
the item's group are (each rank's progress file: the ledger writes "inside" a collective, this watch
"waiting" on one, the entry "finished" after the item). When every rank of the group is waiting or
has finished the item, and they are not all waiting on the same collective, no wait can ever
complete: that is a deadlock, and after the picture has held still for `STABLE_S` the first rank to see
it raises `Deadlock`, which names who waits where, and publishes it: the group's other waiting ranks
give up at once with the same picture. gloo completes a send/recv or a reduce-scatter only inside
`wait()`, and a functional collective (DTensor's) is waited through `_functional_collectives.wait_tensor`
(which the watch also replaces), so a rank blocked in one cannot poll: a thread watches for it, and once it
sees the deadlock the rank cannot be unblocked from Python (gloo's wait ends only when a peer process goes or
the process-group timeout fires), so the thread hands the verdict to `give_up` (the rank entry records it as
the item's result and leaves; the grader runs the remaining checks in fresh ranks). The process-group timeout
stays the backstop.
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed._functional_collectives as funcol

from launch.course_pg import Deadlock
from launch.switchboard import deadlock_message
from tpkit.progress import ProgressFile, read_progress

STABLE_S = 0.5           # the same all-blocked picture this long (a collective completes in ms) means none will
STABLE_P2P_S = 3.0       # ... and when every wait is a send/recv, whose data may still be on the way
CHECK_EVERY_S = 0.05
P2P = ("send", "recv")
_OpType = torch._C._distributed_c10d.OpType
_P2P_TYPES = {int(_OpType.SEND): "send", int(_OpType.RECV): "recv", int(_OpType.RECVANYSOURCE): "recv"}
# gloo works whose is_completed() turns true by itself (measured); the others complete only inside wait()
_POLLABLE = {int(getattr(_OpType, n)) for n in ("BROADCAST", "ALLREDUCE", "ALLREDUCE_COALESCED", "REDUCE", "ALLGATHER",
                                                 "_ALLGATHER_BASE", "ALLGATHER_COALESCED", "GATHER", "SCATTER",
                                                 "ALLTOALL_BASE", "ALLTOALL", "BARRIER")}


class Watch:
    """One per rank process. `begin(item, group_ranks, ledger)` before an item, `end()` after it."""

    def __init__(self, outdir: str, job_rank: int):
        self.outdir, self.job_rank = outdir, job_rank
        self.item = None
        self.ranks: list[int] = []
        self.ledger = None
        self.waiting_on: str | None = None      # "all_reduce #2 (forward)" while blocked in a wait
        self.give_up = None                      # give_up(message): record a deadlock verdict and leave (entry)
        work = torch._C._distributed_c10d.Work
        self._orig = work.wait
        watch = self

        def wait(w, *args, **kwargs):
            if watch.item is None or args or kwargs:      # outside an item, or the caller set its own timeout
                return watch._orig(w, *args, **kwargs)
            return watch._wait(w)

        work.wait = wait
        # DTensor's collectives are functional: their AsyncCollectiveTensor waits through this module function
        self._orig_wait_tensor = funcol.wait_tensor

        def wait_tensor(tensor):
            return watch.wait_functional(lambda: watch._orig_wait_tensor(tensor))
        funcol.wait_tensor = wait_tensor

    def progress_path(self, job_rank: int) -> str:
        return os.path.join(self.outdir, f"rank{job_rank}.progress")

    def begin(self, item_id: str, ranks: list[int], ledger):
        self.item, self.ranks, self.ledger, self.verdict = item_id, ranks, ledger, None

    def end(self):
        if self.item is not None and self.verdict is None:   # a deadlock verdict stays published
            self._write({"item": self.item, "where": "finished"})
        self.item = None

    def _write(self, state: dict):
        ProgressFile.at(self.progress_path(self.job_rank)).write(state)

    def _read(self, job_rank: int) -> dict:
        return read_progress(self.progress_path(job_rank))

    def _announce(self, kind: str | None):
        """Publish which collective this rank now waits in: a send/recv, the latest of its kind; else the last issued."""
        entries = self.ledger.entries if self.ledger is not None else []
        if kind:
            op, index = kind, sum(1 for e in entries if e.get("op") == kind) or "?"
        else:
            op, index = (entries[-1].get("op"), entries[-1].get("index")) if entries else ("a collective", "?")
        self._write({"item": self.item, "where": "waiting", "op": op, "index": index,
                     "phase": getattr(self.ledger, "phase", "?")})
        self.waiting_on = f"{op} #{index} ({getattr(self.ledger, 'phase', '?')})"

    def wait_functional(self, wait):
        """A functional collective's wait (`wait()` runs `_c10d_functional.wait_tensor`, which blocks in C++):
        watched by a thread, as a blocking wait is."""
        if self.item is None:
            return wait()
        self._announce(None)
        try:
            return self._wait_blocking(wait)
        finally:
            self.waiting_on = None
            self._write({"item": self.item, "where": "between collectives",
                         "phase": getattr(self.ledger, "phase", "?")})

    def _wait(self, work):
        if work.is_completed():
            return self._orig(work)
        self._announce(_P2P_TYPES.get(int(work._get_op_type())))
        try:
            if int(work._get_op_type()) not in _POLLABLE:
                return self._wait_blocking(lambda: self._orig(work))
            self._poll(work.is_completed)
        except Deadlock as d:
            # published, so that the group's other waiting ranks give up at once with the same picture
            self.verdict = str(d)
            self._write({"item": self.item, "where": "deadlock", "message": self.verdict})
            raise
        finally:
            self.waiting_on = None
        self._write({"item": self.item, "where": "between collectives", "phase": getattr(self.ledger, "phase", "?")})
        return self._orig(work)

    def _poll(self, done) -> None:
        """Wait until done(); raise Deadlock once the group's all-blocked picture has held still."""
        delay, picture, since = 1e-4, None, 0.0
        next_check = time.monotonic() + CHECK_EVERY_S
        while not done():
            time.sleep(delay)
            delay = min(2 * delay, 5e-3)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + CHECK_EVERY_S
            for r in self.ranks:                 # a peer already judged this item's deadlock
                peer = self._read(r)
                if peer.get("item") == self.item and peer.get("where") == "deadlock":
                    raise Deadlock(peer.get("message", "deadlock"))
            seen = self._deadlock_picture()
            if seen is None or seen != picture:
                picture, since = seen, now
            elif now - since >= (STABLE_P2P_S if all(s[0] == "finished" or s[1] in P2P for s in seen) else STABLE_S):
                raise Deadlock(self._message(seen))

    def _wait_blocking(self, wait):
        """gloo completes a send/recv or a reduce-scatter only inside wait(), so it cannot be polled: wait for
        real, and let a thread watch the picture meanwhile. A deadlock cannot be broken from here, so once the
        thread sees one it publishes it and hands it to `give_up` (the rank records it and leaves at once);
        without a give_up, the process-group timeout ends the wait and the picture becomes the verdict."""
        finished, seen = threading.Event(), []
        item = self.item

        def watch():
            try:
                self._poll(finished.is_set)
            except Deadlock as d:
                seen.append(str(d))
                if self.give_up is not None and not finished.is_set() and self.item == item:
                    self.verdict = str(d)
                    self._write({"item": item, "where": "deadlock", "message": self.verdict})
                    self.give_up(self.verdict)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            return wait()
        except Exception as exc:
            if seen:
                raise Deadlock(seen[0]) from exc
            raise
        finally:
            finished.set()
            thread.join(timeout=1.0)

    def _deadlock_picture(self) -> tuple | None:
        """The group's states when no wait can complete (all waiting or finished, not all on one collective)."""
        states = []
        for r in self.ranks:
            s = self._read(r)
            finished = s.get("item") != self.item or s.get("where") in ("finished", "done", "deadlock")
            if not finished and s.get("where") != "waiting":
                return None                     # someone is still computing or issuing: not (yet) stuck
            states.append(("finished",) if finished else ("waiting", s.get("op"), s.get("index"), s.get("phase")))
        waits = {s for s in states if s[0] == "waiting"}
        if len(waits) == 1 and len(states) == len([s for s in states if s[0] == "waiting"]) \
                and next(iter(waits))[1] not in P2P:
            return None                         # all in the same collective: slow, not stuck
        return tuple(states)

    @staticmethod
    def _message(picture: tuple) -> str:
        return deadlock_message([("waits", f"{s[1]} #{s[2]} ({s[3]})", s[1]) if s[0] == "waiting" else ("finished",)
                                 for s in picture])
