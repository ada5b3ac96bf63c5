"""The "course" process-group backend: a rank's collectives are carried out by the switchboard, outside its box.

A grading rank has no network and no folder another rank can see: its only way to another rank is the
socket its launcher gave it (COURSE_SWITCHBOARD_FD). Each collective it posts there is matched with its
peers', computed and recorded by the switchboard (`launch.switchboard`), which answers with this rank's
part of the result. So what a rank communicated, and in which order, is known outside its process: a
rank can lie about everything it does in Python, not about what it sent and received.

Every way torch reaches a process group lands here: `dist.*` calls, async ops and their `Work.wait`,
functional collectives (DTensor), autograd's backward. A wait tells the switchboard this rank is blocked,
so a deadlock is seen as soon as every rank is blocked or done (no timeout), and the wait ends with
`Deadlock`: a BaseException, so the student's `except Exception` cannot swallow it.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from launch.course_kernels import KERNELS, SPARSE_KERNELS, script_op, unbox
from launch.wire import ALIGN, SHM_MIN, Arena, arena_layout, encode, encode_shared, read_frame

BACKEND = "course"


class Deadlock(BaseException):
    """The switchboard saw every rank blocked or done: this wait can never complete."""


class ArenaSpace:
    """Which bytes of this rank's arena hold a post that is not answered yet: first fit, freed at the answer."""

    def __init__(self, size: int):
        self.free = [(0, size)]                 # (offset, bytes), by offset, never touching
        self.lock = threading.Lock()

    def take(self, n: int) -> int | None:
        with self.lock:
            for i, (at, room) in enumerate(self.free):
                if room >= n:
                    self.free[i:i + 1] = [(at + n, room - n)] if room > n else []
                    return at
        return None

    def give(self, at: int, n: int):
        with self.lock:
            spans = sorted(self.free + [(at, n)])
            merged = [spans[0]]
            for start, room in spans[1:]:
                last, last_room = merged[-1]
                if last + last_room == start:
                    merged[-1] = (last, last_room + room)
                else:
                    merged.append((start, room))
            self.free = merged


def _span(tensors) -> int:
    """The arena bytes `tensors` take (tensors only: a coalesced op's nested lists are not sent there)."""
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in tensors):
        return -1
    return arena_layout([(t.dtype, list(t.shape)) for t in tensors])[1]


class Link:
    """This rank's socket to the switchboard: posts, and a reader thread that completes them. A large post's tensors
    go through the rank's arena (`launch.wire.Arena`), where the answer comes back, in room the post reserves for the
    larger of the two."""

    def __init__(self, fd: int, arena: Arena | None = None):
        self.sock = socket.socket(fileno=fd)
        self.arena = arena
        self.space = ArenaSpace(arena.size) if arena else None
        self.send_lock = threading.Lock()
        self.seq = 0
        self.pending: dict[int, tuple] = {}     # seq -> (work, deliver, (arena offset, bytes) or None)
        self.replies: list = []
        self.reply_ready = threading.Condition()
        self.phase = lambda: "setup"            # the harness names the phase its collectives are in
        self.closed: str | None = None
        self.waiting = False                    # the main thread is blocked in a wait
        self.works: list = []                   # this item's works (dropped when the next item begins)
        self.holding: list = []                 # those that still hold their output tensors
        threading.Thread(target=self._read, name="switchboard-reader", daemon=True).start()

    def _send(self, header: dict, tensors=()):
        data = encode(header, tensors)
        with self.send_lock:
            self.sock.sendall(data)

    def post(self, header: dict, tensors, deliver, result=()) -> "CourseWork":
        """`result`: what the Work's future carries when it is done (and `Work.result()` returns): the op's output
        tensors, as gloo's Work gives them."""
        with self.send_lock:
            self.seq += 1
            seq = self.seq
        self._let_go()
        work = CourseWork(self, seq, header["op"], result)
        header = {**header, "k": "op", "seq": seq, "phase": self.phase()}
        # room for the larger of what it sends and what comes back, each answer tensor aligned (an all-to-all's come
        # in as many pieces as the group has ranks)
        room = max(_span(tensors), _span(result)) + ALIGN * len(header["ranks"]) \
            if self.space and "sparse" not in header else -1
        at = self.space.take(room) if room >= SHM_MIN else None
        self.pending[seq] = (work, deliver, None if at is None else (at, room))
        self.works.append(work)     # alive while torch holds it: a collected Python Work would wait forever
        if work.outputs:
            self.holding.append(work)
        if at is None:
            self._send(header, tensors)
        else:
            frame = encode_shared({**header, "room": room}, tensors, self.arena, at)
            with self.send_lock:
                self.sock.sendall(frame)
        return work

    def _let_go(self):
        """A finished Work that nothing but these lists holds (its caller dropped it; torch's C++ side, which may still
        wait on it, is not counted) lets go of its output tensors, as gloo's Work would be freed with them: a buffer
        the student drops must be freed (week 8 counts them), though the Work itself stays alive for the item."""
        keep = []
        for work in self.holding:       # referrers when no one else holds it: the two lists, `work`, the argument
            if work.done.is_set() and sys.getrefcount(work) <= 4:
                work._let_go()
            else:
                keep.append(work)
        self.holding = keep

    def request(self, header: dict, tensors=()) -> tuple[dict, list]:
        """A harness message that the switchboard answers (an item's start): blocks for the answer."""
        self.works = [w for w in self.works if not w.done.is_set()]
        self.holding = [w for w in self.holding if not w.done.is_set()]
        self._send(header, tensors)
        with self.reply_ready:
            while not self.replies:
                if self.closed:
                    raise ConnectionError(self.closed)
                self.reply_ready.wait(0.1)
            return self.replies.pop(0)

    def tell(self, header: dict, tensors=()):
        self._send(header, tensors)

    def _read(self):
        try:
            while True:
                frame = read_frame(self.sock, self.arena)
                if frame is None:
                    break
                header, tensors = frame
                kind = header.get("k")
                if kind in ("done", "error"):
                    work, deliver, room = self.pending.pop(header["seq"])
                    try:
                        if kind == "done":
                            if type(header.get("src")) is int:     # a recv from any source: whose send it got
                                work.source = header["src"]
                            deliver(tensors)          # copies out of the arena: its room is free after
                    finally:
                        del tensors, frame
                        if room is not None:
                            self.space.give(*room)
                    if kind == "done":
                        work._finish(None)
                    else:
                        err = Deadlock if header.get("deadlock") else RuntimeError
                        work._finish(err(header.get("msg", "the collective failed")))
                    # no reference kept here: a buffer the student drops must be freed (week 8 counts them)
                    del work, deliver
                else:
                    with self.reply_ready:
                        self.replies.append((header, tensors))
                        self.reply_ready.notify_all()
        finally:
            self.closed = "the switchboard closed this rank's link"
            for work, _, _ in list(self.pending.values()):
                work._finish(RuntimeError(self.closed))
            with self.reply_ready:
                self.reply_ready.notify_all()


_T = torch._C._distributed_c10d.OpType
_OP_TYPES = {"all_reduce": _T.ALLREDUCE, "all_gather": _T._ALLGATHER_BASE, "reduce_scatter": _T._REDUCE_SCATTER_BASE,
             "all_to_all": _T.ALLTOALL_BASE, "broadcast": _T.BROADCAST, "barrier": _T.BARRIER, "send": _T.SEND,
             "recv": _T.RECV, "reduce": _T.REDUCE, "gather": _T.GATHER, "scatter": _T.SCATTER}


def _wait_hooks() -> list:
    """The on_wait hooks of the wrappers around `Work.wait`, innermost first (tpkit.dispatch marks them)."""
    hooks, wait = [], dist.Work.wait
    while getattr(wait, "on_wait", None) is not None:
        hooks.append(wait.on_wait)
        wait = wait.inner
    return hooks[::-1]


class CourseWork(dist.Work):
    """A posted collective: done when the switchboard answers. `wait` polls, so SIGALRM still interrupts it."""

    def __init__(self, link: Link, seq: int, op: str, result=()):
        super().__init__()
        self.link, self.seq, self.op = link, seq, op
        self.outputs = list(result)     # the future's value: a list of tensors (of lists, for all_gather_coalesced)
        self.source: int | None = None  # a recv from any source: the sender's rank in the group
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.fut: torch.futures.Future | None = None     # made when asked for (torch's C++ asks at once: DDP)
        self.lock = threading.Lock()

    def _finish(self, error):
        with self.lock:
            self.error = error
            self.done.set()
            fut = self.fut
        if fut is not None:            # its callbacks (a DDP comm hook's then()) run here, outside the lock
            self._complete(fut)

    def _complete(self, fut):
        if self.error is None:
            fut.set_result(self.outputs)
        else:
            fut.set_exception(RuntimeError(str(self.error)))

    def _let_go(self):
        """Its caller dropped it once it was done: the output tensors are no longer held here (`Link._let_go`)."""
        with self.lock:
            self.outputs, self.fut = [], None

    def wait(self, timeout=None):
        # a Python caller's wait (torch's own C++ callers pass a timeout) is seen by the measuring modes that wrap
        # `Work.wait` (tpkit.dispatch), as with gloo; the wrappers cannot call this override back (pybind11 takes
        # a wrapper named `wait` for the override itself), so their hooks are called here
        hooks = _wait_hooks() if timeout is None else []
        started = time.perf_counter()
        self._block()
        returned = time.perf_counter()
        for hook in hooks:
            hook(self, started, returned)
        return True

    def _block(self):
        if not self.done.is_set():
            self.link.tell({"k": "wait", "seq": self.seq})   # blocked: the switchboard may judge a deadlock
            self.link.waiting = True
            try:
                while not self.done.wait(0.05):
                    pass
            finally:
                self.link.waiting = False
        if self.error is not None:
            raise self.error

    def _get_op_type(self):
        return _OP_TYPES[self.op]

    def is_completed(self):
        return self.done.is_set()

    def is_success(self):
        return self.done.is_set() and self.error is None

    def get_future(self):
        with self.lock:
            if self.fut is None:
                self.fut = torch.futures.Future()
                if self.done.is_set():
                    self._complete(self.fut)
            return self.fut

    def result(self):
        """The op's output tensors once it is done, as gloo's `Work.result()` gives them."""
        self._block()
        return self.outputs

    def _source_rank(self):
        """Which rank of the group a recv from any source got its message from (`dist.recv(t)` returns it)."""
        if self.source is None:
            raise RuntimeError("_source_rank: this Work is not a recv from any source, or is not done yet")
        return self.source

    source_rank = _source_rank


class CourseGroup(dist.ProcessGroup):
    """A process group with no backend of its own: torch's c10d ops on it run the kernels of
    `launch.course_kernels`, which post to the switchboard. The ops go through torch's dispatcher as with gloo, so dispatch modes (tpkit's ledger)
    still see every collective; the few methods whose C++ default would look for a backend instead are routed
    to the same ops here."""

    def __init__(self, link: Link, rank: int, size: int, name: str, ranks: list[int]):
        super().__init__(rank, size)
        self.link, self.name_, self.ranks = link, name, ranks

    def getBackendName(self):
        return BACKEND

    def getGroupName(self):
        return self.name_

    def getGroupDesc(self):
        return self.name_

    # torch calls these on the group itself (not through an op): each runs the op, so a dispatch mode sees it
    def all_gather_single(self, out, inp, opts):
        return unbox(torch.ops.c10d._allgather_base_(out, inp, self.boxed(), True, -1)[1])

    def all_gather_single_coalesced(self, outs, inps, opts):
        return unbox(torch.ops.c10d.allgather_into_tensor_coalesced_(outs, inps, self.boxed(), True))

    def reduce_scatter_single(self, out, inp, opts):
        return unbox(torch.ops.c10d._reduce_scatter_base_(out, inp, self.boxed(), script_op(opts.reduceOp),
                                                           True, -1)[1])

    def reduce_scatter_single_coalesced(self, outs, inps, opts):
        return unbox(torch.ops.c10d.reduce_scatter_tensor_coalesced_(outs, inps, self.boxed(),
                                                                      script_op(opts.reduceOp), True, -1))

    def all_to_all_single(self, out, inp, out_splits, in_splits, opts):
        return unbox(torch.ops.c10d.alltoall_base_(out, inp, self.boxed(), out_splits, in_splits, True, -1))


_LINK: Link | None = None


def link() -> Link:
    """This process's link (made from COURSE_SWITCHBOARD_FD and COURSE_ARENA_FD, once: the variables are gone
    after)."""
    global _LINK
    if _LINK is None:
        fd = os.environ.pop("COURSE_SWITCHBOARD_FD", None)
        arena = os.environ.pop("COURSE_ARENA_FD", None)
        if fd is None:
            raise RuntimeError("the course backend runs only in a rank whose launcher has a switchboard "
                               "(COURSE_SWITCHBOARD=folder for python -m launch.forkrun)")
        _LINK = Link(int(fd), Arena(int(arena)) if arena else None)
    return _LINK


def _create(opts, backend_opts):
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return CourseGroup(link(), opts.group_rank, opts.group_size, str(opts.group_id), ranks)


_LIBRARY = None


def register():
    """The backend, and the kernels of torch's c10d ops on CPU: this process's collectives are the switchboard's
    (torch keeps one CPU kernel per op, so gloo cannot run in this process any more)."""
    global _LIBRARY
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _LIBRARY = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():   # "overriding a previously registered kernel": on purpose
        warnings.simplefilter("ignore")
        for name, kernel in KERNELS.items():
            _LIBRARY.impl(name, kernel, "CPU")
        for name, kernel in SPARSE_KERNELS.items():
            _LIBRARY.impl(name, kernel, "SparseCPU")


def available() -> bool:
    """Whether this process was started with a switchboard."""
    return _LINK is not None or "COURSE_SWITCHBOARD_FD" in os.environ
