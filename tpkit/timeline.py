"""Per-rank timelines of compute and communication, and how much of the communication was hidden.

A `Timeline` (a TorchDispatchMode) timestamps GEMMs and copies, P2P posts and the time spent blocked
in Work.wait(); `overlap_efficiency` turns one rank's timeline into hidden / total communication.
An `IssueLog` records the order in which collectives were issued, GEMMs ran and waits returned: whether a
collective had a GEMM under it, without clocks; with a `Provenance`, which GEMM it was (by the buffers it
reads). CPU clocks: on a GPU these are launch times; use torch.profiler / nsys there.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from tpkit.dispatch import MeasuringMode
from tpkit.ledger import _OPS, _tensors


# -- per-rank timelines and overlap efficiency ----------------------------------------------------
_P2P = {"send", "recv_"}


class Timeline(MeasuringMode):
    """Timestamps on this rank: compute ops (GEMMs and copies, merged), P2P posts, time blocked in Work.wait().

    Work.wait is seen only while the timeline is active (MeasuringMode.on_wait). CPU clocks: on a GPU, GEMM times here are
    launch times; use torch.profiler / nsys there.
    """

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, float, float]] = []     # (kind, start, end), kind in gemm/post/wait
        self.t0 = time.perf_counter()

    def on_wait(self, work, started, returned):
        self.events.append(("wait", started, returned))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        s = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        e = time.perf_counter()
        if func.namespace == "c10d":
            if name in _P2P:
                self.events.append(("post", s, e))
        elif self.events and self.events[-1][0] == "gemm" and s - self.events[-1][2] < 2e-5:
            self.events[-1] = ("gemm", self.events[-1][1], e)          # merge back-to-back compute ops
        else:
            self.events.append(("gemm", s, e))                         # compute: GEMMs and the copies around them
        return out

    def lanes(self):
        """{'compute': [(start, end)], 'comm': [(post, last wait return)]}, seconds since the timeline began."""
        comp = [(s - self.t0, e - self.t0) for k, s, e in self.events if k == "gemm"]
        comm, start, last = [], None, None
        for kind, s, e in self.events:            # a comm step: from its first post to the wait before the next post
            if kind == "post" and (start is None or last is not None):
                if start is not None:
                    comm.append((start - self.t0, last - self.t0))
                start, last = s, None
            elif kind == "wait" and start is not None:
                last = e
        if start is not None and last is not None:
            comm.append((start - self.t0, last - self.t0))
        return {"compute": comp, "comm": comm}

    def blocked(self) -> float:
        return sum(e - s for k, s, e in self.events if k == "wait")


def ring_exchange_only(x_s, steps, group=None):
    """`steps` ring P2P exchanges of x_s with no GEMM: the communication an overlapped ring must hide."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    nxt, prv = glob((r + 1) % t), glob((r - 1) % t)
    a, b = x_s.contiguous(), torch.empty_like(x_s)
    for _ in range(steps):
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt, group), dist.P2POp(dist.irecv, b, prv, group)]):
            w.wait()
        a, b = b, a


def lane_overlap(lanes) -> tuple[float, float]:
    """(hidden, total) seconds: total = length of the comm intervals (post -> wait returned), hidden = the part
    of them covered by a GEMM on this rank. A comm step whose wait was entered after it had finished counts
    until that wait returned, but it is then covered by the GEMM anyway: hidden/total stays honest."""
    total = sum(e - s for s, e in lanes["comm"])
    hidden = sum(max(0.0, min(e, ge) - max(s, gs)) for s, e in lanes["comm"] for gs, ge in lanes["compute"])
    return hidden, total


def overlap_efficiency(fn, x_s=None, comm_payload=None, group=None, reps=5):
    """hidden / total communication on this rank from per-rank timestamps (a report, not a grade).

    Median over `reps` runs after one warm-up of `lane_overlap` of the Timeline of `fn()`. Also returns the
    median time of the same P2P steps alone (`ring_exchange_only` of `comm_payload`, if given) for scale.
    Returns (efficiency in [0, 1], comm-alone seconds or nan, median exposed seconds blocked in wait, Timeline).
    """
    t = dist.get_world_size(group)
    effs, alone, exposed = [], [], []
    for i in range(reps + 1):
        if comm_payload is not None:
            dist.barrier(group=group)
            s = time.perf_counter()
            ring_exchange_only(comm_payload, t - 1, group)
            if i:
                alone.append(time.perf_counter() - s)
        dist.barrier(group=group)
        with Timeline() as tl:
            fn()
        if i:
            hidden, total = lane_overlap(tl.lanes())
            effs.append(hidden / total if total > 0 else 0.0)
            exposed.append(tl.blocked())
    return (statistics.median(effs), statistics.median(alone) if alone else float("nan"),
            statistics.median(exposed), tl)


# -- the order of issues, GEMMs and waits ------------------------------------------------------------
_OpType = torch._C._distributed_c10d.OpType
_AG_TYPES = {int(getattr(_OpType, n)) for n in ("ALLGATHER", "_ALLGATHER_BASE", "ALLGATHER_COALESCED")}
_P2P_TYPES = {int(getattr(_OpType, n)) for n in ("SEND", "RECV", "RECVANYSOURCE")}
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


_MOVES = frozenset({"clone", "_to_copy", "copy_", "cat", "stack", "index_select", "_unsafe_view"})


class Provenance:
    """Which named tensors a buffer holds: storages tagged with names, and the tags carried by the ops that only
    move data (clone, copy_, cat, ...), so that a GEMM is recognised by what it reads even when an operand is a
    transposed contiguous copy of a tagged buffer. Storages are held weakly (StorageWeakRef): a freed buffer's
    memory, reused by another tensor, never passes its tags on."""

    def __init__(self):
        self._tags: dict[int, tuple[StorageWeakRef, set[str]]] = {}    # storage id -> (weak ref, names)

    @staticmethod
    def _storage(t):
        try:
            s = t.untyped_storage()
        except Exception:      # noqa: BLE001 (no storage: a sparse or wrapper tensor)
            return None
        return s if s.nbytes() > 0 else None

    def tag(self, obj, *names: str):
        """Every tensor in `obj` (a tensor, or lists of them) now holds `names`."""
        for t in (_tensors(obj) if names else ()):
            s = self._storage(t)
            if s is not None:
                hit = self._tags.get(s._cdata)
                if hit is None or hit[0].expired():
                    hit = self._tags[s._cdata] = (StorageWeakRef(s), set())
                hit[1].update(names)

    def of(self, obj) -> set[str]:
        """The names the tensors in `obj` (a tensor, or lists of them) hold, together."""
        names = set()
        for t in _tensors(obj):
            s = self._storage(t)
            hit = self._tags.get(s._cdata) if s is not None else None
            if hit is not None and not hit[0].expired():
                names |= hit[1]
        return names

    def carry(self, func, args, kwargs, out):
        """After `func` ran: if it only moves data, its outputs (copy_'s destination) hold what its inputs held."""
        if func.namespace == "aten" and func._opname in _MOVES:
            self.tag(out, *self.of((args, list((kwargs or {}).values()))))


class IssueLog(MeasuringMode):
    """While active: the order in which this rank issued all-gathers / reduce-scatters, ran GEMMs and returned
    from a wait (Work.wait, or wait_tensor for functional collectives). Launch order, not time: on a GPU use a
    profiler. A wait's kind comes from its Work's op type (an all-gather or a send/recv type, else the
    reduce-scatter: gloo's reduce_scatter_single has an UNKNOWN one)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._functional: list[tuple[torch.Tensor, str]] = []     # a functional collective's output, its kind

    def on_wait(self, work, started, returned):
        op = int(work._get_op_type())
        self.events.append(("wait", "all_gather" if op in _AG_TYPES else "p2p" if op in _P2P_TYPES
                            else "reduce_scatter"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func._opname
        kind = _OPS.get(name) if ns in ("c10d", "_c10d_functional") else None
        if kind in ("all_gather", "reduce_scatter"):
            self.events.append(("issue", kind))
            if ns == "_c10d_functional" and isinstance(out, torch.Tensor):
                self._functional.append((out, kind))
        elif ns == "_c10d_functional" and name == "wait_tensor":
            got = args[0] if args else None
            self.events.append(("wait", next((k for o, k in self._functional if o is got), "?")))
        elif ns == "aten" and name in GEMM_OPS:
            self.events.append(("gemm", self.gemm_label(func, args, out)))
        return out

    def gemm_label(self, func, args, out) -> str:
        """What a GEMM's event records: its op name; a subclass may name it by the buffers it reads."""
        return func._opname

    def in_flight(self, op: str) -> list[int]:
        """For each `op` issued, in order: the GEMMs run between issuing it and its wait (-1: never waited).

        Waits of one kind are matched to the issues of that kind first in, first out."""
        spans, open_ = [], []                   # open_: indices into spans still waiting for their wait
        for kind, what in self.events:
            if kind == "issue" and what == op:
                spans.append(0)
                open_.append(len(spans) - 1)
            elif kind == "gemm":
                for i in open_:
                    spans[i] += 1
            elif kind == "wait" and what == op and open_:
                open_.pop(0)
        return [-1 if i in open_ else n for i, n in enumerate(spans)]

    def overlap_code(self, op: str, gemm: str | None = None) -> int:
        """The first `op` issued: 1 = a GEMM (labelled `gemm`, if given) ran between issuing and waiting on it,
        0 = none did (serialised), 2 = never waited, 3 = never issued. A wait goes to the oldest open issue of
        its kind (of any kind when its kind is unknown, "?")."""
        issues, open_ = [], []                # issues: [kind, GEMMs while open, waited]; open_: their indices
        for kind, what in self.events:
            if kind == "issue":
                issues.append([what, 0, False])
                open_.append(len(issues) - 1)
            elif kind == "gemm" and gemm in (None, what):
                for i in open_:
                    issues[i][1] += 1
            elif kind == "wait":
                i = next((i for i in open_ if what in ("?", issues[i][0])), None)
                if i is not None:
                    open_.remove(i)
                    issues[i][2] = True
        first = next((x for x in issues if x[0] == op), None)
        if first is None:
            return 3
        return 2 if not first[2] else (1 if first[1] else 0)


def plot_timelines(lanes_by_rank: dict, title: str, ax=None):
    """One lane per rank and stream (compute / comm), bars in ms."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    ranks = sorted(lanes_by_rank)
    labels = []
    for i, r in enumerate(ranks):
        for j, (lane, color) in enumerate((("compute", "tab:blue"), ("comm", "tab:orange"))):
            y = 2 * i + j
            ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in lanes_by_rank[r][lane]], (y - 0.4, 0.8),
                           facecolors=color, edgecolor="k", linewidth=0.3)
            labels.append(f"rank {r} {lane}")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("time since the step began (ms)")
    ax.set_title(title)
    return ax
