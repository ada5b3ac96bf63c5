"""The switchboard: the launcher carries out every collective of its ranks and records it, outside their reach.

Each rank has one socket to its launcher (`launch.course_pg`) and no other way to a peer (grading
isolates the ranks: `launch.isolation`). A rank posts a collective with its own tensors; when every
member of the group has posted the group's next collective, the switchboard checks that they agree (op,
shapes, dtypes, root), computes each rank's result and answers. A send waits for its recv (rendezvous).
What each rank posted is recorded per item, in the ledger's format (`tpkit.ledger`): op, bytes, dtype,
shape (this rank's input), bytes sent on a ring, the group size, the phase the rank says it is in.

Items: a rank asks to `begin` item i (every rank, in order); when all live ranks have asked, item i-1's
record is written and each rank gets its own inputs for item i (from the grader's per-rank input file)
and whether any rank failed item i-1. At `end` a rank hands over its result, which is stored at once:
what a rank learns later cannot change an item it has ended.

Deadlocks: a rank that waits on a collective says so. When no live rank is running (each waits, has ended
the item, or is gone) and one of them waits, no wait can ever complete: every waiting rank gets `Deadlock`
with the picture of who waits where, at once, with no timeout, and the item is marked deadlocked.

Nothing a rank sends is trusted: each frame's sizes are checked as they arrive (`launch.wire`), each header field's
type and range before it is used. A frame that breaks a rule, or whose handling fails in any way, closes that rank's
link with a "protocol" event naming the rule (the rank's verdict); the other ranks are served on. What the switchboard
holds for a rank is bounded however it floods (MAX_IN_FLIGHT, MAX_HELD, MAX_BACKLOG, MAX_RESULTS).

Files written under `record_dir` (a folder no rank can see): `comm.json` (per item: each rank's entries
and the item's events) and `rank{r}/{i}.pt` (the result rank r handed over for item i).
"""
from __future__ import annotations

import io
import json
import math
import os
from collections import deque

import torch

from launch.collectives import P2P, REDUCING, disagreement, nbytes, outcome
from launch.wire import MAX_PAYLOAD, MAX_TENSORS, Arena, BadFrame, FrameReader, arena_layout, encode, encode_shared, \
    shape_error
from tpkit.ledger import ring_bytes_sent

MAX_PHASE = 40
SMALL = 1 << 31            # a seq, an item index, a tag, a peer, a row count: the course's ranks send nothing larger
MAX_NAME = 256             # characters of an op's or a group's name
REDUCE_OPS = ("sum", "avg", "product", "min", "max")
# what the launcher holds for one rank, however it floods (besides the one frame it is reading, wire.MAX_PAYLOAD):
# its collectives posted and not answered yet, whose tensors wait for the peers' (an all-gather's answers are t times
# as many bytes); the answers it has not read (past this, its socket is not read until it reads them); the results it
# hands over in one launch (written to the grader's disk and read back). A lab's are kilobytes.
MAX_IN_FLIGHT, MAX_HELD = 1024, 64 << 20
# collectives recorded for one rank in one launch: a lab's are hundreds; past this a flood of tiny ones would grow the
# record (kept in memory, written for the grader, who reads at most attempt.COMM_LIMIT of it) without bound
MAX_RECORDED = 16_000
MAX_BACKLOG = 16 << 20
MAX_RESULTS = 64 << 20


class Refused(ValueError):
    """What a rank sent that the switchboard will not carry out: its link is closed, and its verdict for the item
    says why. The text completes "rank 1 ..."."""


def malformed(why: str) -> Refused:
    return Refused(f"sent a malformed message: {why} (only torch.distributed's own calls may write to a rank's link "
                   "to the switchboard)")


def _int(header: dict, key: str, lo: int = 0, default=None) -> int:
    value = header.get(key, default)
    if type(value) is not int or not lo <= value < SMALL:      # type(): a bool is an int to isinstance
        raise malformed(f"`{key}` is not a small integer")
    return value


def _name(header: dict, key: str) -> str:
    value = header.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise malformed(f"`{key}` is not a name of at most {MAX_NAME} characters")
    return value


def _check_fields(header: dict, t: int):
    """The optional fields of a post the collectives read (`launch.collectives`), each of its type and range."""
    for key in ("peer", "tag", "root"):
        if key in header:
            _int(header, key, lo=-SMALL)
    if "reduce" in header and header["reduce"] not in REDUCE_OPS:
        raise malformed(f"`reduce` is not one of {', '.join(REDUCE_OPS)}")
    if "even" in header and type(header["even"]) is not bool:
        raise malformed("`even` is not true or false")
    rows = header.get("out_rows", [])
    if not isinstance(rows, list) or len(rows) > t or not all(type(n) is int and 0 <= n < SMALL for n in rows):
        raise malformed("`out_rows` is not a list of row counts, one per rank of the group")
    want = header.get("want", [])
    if not isinstance(want, list) or len(want) > MAX_TENSORS:
        raise malformed(f"`want` is not a list of at most {MAX_TENSORS} shapes")
    for shape in want:
        why = shape_error(shape)
        if why or math.prod(shape) > MAX_PAYLOAD:     # no frame carries more elements than bytes
            raise malformed(f"`want` holds a shape that is not a list of sizes ({why or 'too many elements'})")


def deadlock_message(states: list[tuple]) -> str:
    """states[label] = ("waits", "all_reduce #2 (forward)", op) | ("finished",)."""
    parts = [f"rank {i} waits in {s[1]}" if s[0] == "waits" else f"rank {i} had finished this check"
             for i, s in enumerate(states)]
    waits = [s for s in states if s[0] == "waits"]
    if waits and all(s[2] in P2P for s in waits) and all(s[0] == "waits" for s in states):
        why = ("Every rank waits for a message no peer is sending: post each send together with its "
               "receive (dist.batch_isend_irecv, or isend before recv) so no rank blocks in its first one.")
    else:
        why = ("A rank that skips or adds a collective, or issues them in another order, leaves the "
               "others waiting forever.")
    return "deadlock: " + "; ".join(parts) + ". " + why


def _room(header: dict, tensors: list) -> tuple[int, int] | None:
    """Where in its arena a post's answer goes: the room the rank reserved there, which must hold its tensors (the
    arena's bounds were checked when they were read, `launch.wire.Arena.views`)."""
    if "shm" not in header:
        return None
    at, room = header["shm"], _int(header, "room")
    if "sparse" in header:       # its indices are checked, then used: they must be the switchboard's own copy
        raise malformed("a sparse tensor in the arena (it goes on the socket)")
    if room < arena_layout([(x.dtype, list(x.shape)) for x in tensors])[1]:
        raise malformed("`room` is smaller than the tensors the post put in its arena")
    return at, room


class Post:
    """One collective a rank posted: its header (op, group, the phase the rank names) and its tensors."""

    def __init__(self, rank: int, header: dict, tensors: list, world: int):
        """Every field is checked before anything reads it (Refused names the first that is wrong); `world`: the
        job's ranks."""
        self.rank, self.header, self.tensors = rank, header, tensors
        self.seq, self.op = _int(header, "seq"), _name(header, "op")
        _name(header, "group")
        ranks = header.get("ranks")
        if not isinstance(ranks, list) or not ranks or len(set(ranks)) != len(ranks) or \
                not all(type(x) is int and 0 <= x < world for x in ranks):
            raise malformed(f"`ranks` is not a list of distinct ranks of this job (0 to {world - 1})")
        self.ranks = ranks                                 # the group's job ranks
        _check_fields(header, len(ranks))
        if self.op == "all_gather" and len(tensors) != 1:
            raise malformed(f"an all_gather carries one tensor, not {len(tensors)}")
        phase = header.get("phase")
        self.phase = phase[:MAX_PHASE] if isinstance(phase, str) else "?"
        peer = header.get("peer", -1)
        self.peer = self.ranks[peer] if self.op in P2P and 0 <= peer < len(self.ranks) else -1
        self.room = _room(header, tensors)                 # (offset, bytes) of the rank's arena it reserved, or None
        # what the switchboard holds until the post is answered: nothing of a payload that stays in the rank's arena
        self.nbytes = 0 if self.room else sum(nbytes(x) for x in tensors)
        self.label = ""          # "all_reduce #2 (forward)", once numbered
        self.order = 0           # its place in the rank's posts of this item, counted by the switchboard


class Conn:
    def __init__(self, rank: int, sock, arena: Arena | None):
        self.rank, self.sock, self.arena = rank, sock, arena
        self.reader = FrameReader(arena)
        self.out = bytearray()
        self.gone = False
        self.handed = 0          # bytes of results this rank has handed over in this launch
        self.posts = 0           # collectives it posted in this launch


class Switchboard:
    def __init__(self, sel, inputs: dict[int, dict], items: list[dict], record_dir: str):
        self.sel, self.inputs, self.record_dir = sel, inputs, record_dir
        self.items = items                          # the job's items in order: {"id", "group": its job ranks}
        self.conns: dict[int, Conn] = {}
        self.index = -1                             # the item every rank is in (-1: before the first)
        self.begun: set[int] = set()                # ranks that asked to begin item index + 1
        self.failed: set[int] = set()               # ranks that said they failed the current item
        self.record: dict[int, dict] = {}           # item index -> {"item", "entries": {rank: [..]}, "events": [..]}
        self._new_item_state()
        os.makedirs(record_dir, mode=0o700, exist_ok=True)

    # -- connections ---------------------------------------------------------------------------------------
    def attach(self, rank: int, sock, arena: Arena | None = None):
        """`arena`: the rank's shared memory with this launcher (`launch.wire.Arena`), for its large payloads."""
        sock.setblocking(False)
        conn = Conn(rank, sock, arena)
        self.conns[sock.fileno()] = conn
        self.sel.register(sock.fileno(), 1, ("switchboard", rank))   # EVENT_READ

    def owns(self, fd: int) -> bool:
        return fd in self.conns

    def on_ready(self, fd: int, events: int):
        conn = self.conns[fd]
        if events & 2:        # EVENT_WRITE
            self._flush(conn)
        if not events & 1:
            return
        if len(conn.out) > MAX_BACKLOG:     # the rank does not read its answers: read nothing of it until it does
            self.sel.modify(fd, 2, ("switchboard", conn.rank))
            return
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.reader.feed(data)
        try:
            while (frame := conn.reader.next_frame()) is not None:
                self._handle(conn, *frame)
        except Exception as exc:   # noqa: BLE001  whatever a rank's frame makes fail is that rank's doing
            self._refuse(conn, exc)
            return
        self._settle()

    def _refuse(self, conn: Conn, exc: Exception):
        """Close the link of a rank whose frame broke a rule or could not be carried out; the item's record says why
        (its verdict), and the launcher serves the other ranks on."""
        if isinstance(exc, BadFrame):
            why = str(malformed(str(exc)))
        elif isinstance(exc, Refused):
            why = str(exc)
        else:
            why = f"sent a message the switchboard could not carry out ({type(exc).__name__}: {str(exc)[:200]})"
        self._event("protocol", f"rank {self._place(conn.rank)} {why}. The switchboard closed its link.", [conn.rank])
        self._drop(conn)

    def _place(self, rank: int) -> int:
        """The rank as the verdict of the item its refusal costs numbers it: its place in the group of the current
        item, or of the next it runs when it has ended this one or sits it out (its job rank when no item says)."""
        start = self.index + 1 if self.index < 0 or rank in self.ended or rank in self.begun else self.index
        for spec in self.items[start:]:
            group = spec.get("group")
            if group is None or rank in group:
                return rank if group is None else group.index(rank)
        return rank

    def _send(self, rank: int, header: dict, tensors=(), room: tuple[int, int] | None = None):
        """`room`: where in the rank's arena the tensors go, if they fit (else on the socket)."""
        conn = self._conn(rank)
        if conn is None or conn.gone:
            return
        if room and tensors and arena_layout([(x.dtype, list(x.shape)) for x in tensors])[1] <= room[1]:
            conn.out += encode_shared(header, tensors, conn.arena, room[0])
        else:
            conn.out += encode(header, tensors)
        self._flush(conn)

    def _flush(self, conn: Conn):
        try:
            while conn.out:
                n = conn.sock.send(conn.out[:1 << 20])
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            conn.out.clear()
        self.sel.modify(conn.sock.fileno(), 1 | (2 if conn.out else 0), ("switchboard", conn.rank))

    def _conn(self, rank: int) -> Conn | None:
        return next((c for c in self.conns.values() if c.rank == rank), None)

    def _drop(self, conn: Conn):
        if conn.gone:
            return
        conn.gone = True
        self.sel.unregister(conn.sock.fileno())
        conn.sock.close()
        self._settle()

    def live(self) -> list[int]:
        return [c.rank for c in self.conns.values() if not c.gone]

    # -- messages --------------------------------------------------------------------------------------------
    def _handle(self, conn: Conn, header: dict, tensors: list):
        """One frame of `conn`'s rank; Refused (or any exception) for one that breaks the protocol."""
        rank, kind = conn.rank, header.get("k")
        if kind == "op":
            post = Post(rank, header, tensors, len(self.conns))
            conn.posts += 1
            if conn.posts > MAX_RECORDED:
                raise Refused(f"posted more than {MAX_RECORDED} collectives in one launch, the most the switchboard "
                              "records for a rank: a loop that never ends, or a collective per element?")
            held = self.open_posts.get(rank, {}).values()
            if len(held) >= MAX_IN_FLIGHT or post.nbytes + sum(p.nbytes for p in held) > MAX_HELD:
                raise Refused(f"posted {MAX_IN_FLIGHT} collectives (or {MAX_HELD >> 20} MiB) that its peers have not "
                              "matched, the most the switchboard holds for a rank: wait on async work (work.wait()) "
                              "before posting more")
            self._post(post)
        elif kind == "wait":
            seq = _int(header, "seq")
            if seq in self.open_posts.get(rank, {}):
                if self.deadlocked:
                    self._fail(rank, seq, self.deadlocked, deadlock=True)
                else:
                    self.blocked[rank] = seq
        elif kind == "begin":
            index = _int(header, "index")
            if index != self.index + 1:     # items come in the job's order, none skipped
                raise malformed(f"it asked to begin item {index} during item {self.index} (items come in the job's "
                                "order)")
            self.begun.add(rank)
            self.blocked.pop(rank, None)
        elif kind == "end":
            index, failed = _int(header, "index"), header.get("failed", False)
            if type(failed) is not bool:
                raise malformed("`failed` is not true or false")
            conn.handed += sum(nbytes(x) for x in tensors)
            if conn.handed > MAX_RESULTS:
                raise Refused(f"handed over more than {MAX_RESULTS >> 20} MiB of results in one launch, the most the "
                              "grader reads back of a rank: return only the tensors the check asks for")
            self._store_result(rank, index, tensors)
            if failed:
                self.failed.add(rank)
            self.ended.add(rank)
            self.blocked.pop(rank, None)
        else:
            raise malformed("`k` is not one of op, wait, begin, end")

    def _store_result(self, rank: int, index: int, tensors: list):
        if index != self.index or rank in self.ended or len(tensors) != 1 or tensors[0].dtype != torch.uint8:
            return            # an item other than the current one, twice, or not one byte tensor: ignored
        folder = os.path.join(self.record_dir, f"rank{rank}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with open(os.path.join(folder, f"{index}.pt"), "wb") as f:
            f.write(tensors[0].numpy().tobytes())

    # -- items -------------------------------------------------------------------------------------------
    def _new_item_state(self):
        self.counters: dict[tuple, int] = {}        # (rank, group) -> collectives posted on it in this item
        self.slots: dict[tuple, dict[int, Post]] = {}   # (group, n) -> rank -> post
        self.sends: dict[tuple, deque] = {}         # (group, src, dst, tag) -> posted sends not yet received
        self.recvs: dict[tuple, deque] = {}
        self.open_posts: dict[int, dict[int, Post]] = {}   # rank -> seq -> post not yet answered
        self.op_counts: dict[tuple, int] = {}       # (rank, op) -> number, for "all_reduce #2"
        self.posted: dict[int, int] = {}            # rank -> collectives it posted in this item (its program order)
        self.blocked: dict[int, int] = {}           # rank -> the seq it waits on
        self.ended: set[int] = set()
        self.deadlocked: str = ""
        self.group: list[int] | None = None         # the job ranks running this item (None: every rank)

    def _item(self) -> dict:
        return self.record.setdefault(self.index, {"item": None, "entries": {}, "events": []})

    def _event(self, kind: str, msg: str, ranks: list[int]):
        self._item()["events"].append({"kind": kind, "msg": msg, "ranks": sorted(ranks)})

    def _settle(self):
        """After any message: open the next item when every live rank asked for it; judge a deadlock."""
        live = self.live()
        if live and all(r in self.begun for r in live):
            self._next_item(live)
            return
        running = [r for r in live if r not in self.blocked and r not in self.ended and r not in self.begun]
        if running or not self.blocked or self.deadlocked:
            return
        self._judge_deadlock(live)

    def _next_item(self, live: list[int]):
        failed = bool(self.failed)
        self.write_record()
        self.index += 1
        self._new_item_state()
        self.failed = set()
        item = self._item()
        # which item this is, and which ranks run it, come from the job's list, never from a rank (it could ask for
        # a later item's inputs, or name a group of its choosing)
        spec = self.items[self.index] if self.index < len(self.items) else {}
        item["item"], self.group = spec.get("id"), spec.get("group")
        for r in live:
            self.begun.discard(r)
            mine = self.inputs.get(r, {}).get(item["item"], {})
            names = sorted(mine)
            self._send(r, {"k": "start", "index": self.index, "failed_last": failed, "names": names},
                       [mine[n] for n in names])

    def _judge_deadlock(self, live: list[int]):
        by_group: dict[tuple, list[int]] = {}
        every = [c.rank for c in self.conns.values()]                # a rank outside the item's group: the job
        for r in self.blocked:
            by_group.setdefault(tuple(self.group if self.group and r in self.group else every), []).append(r)
        for group in by_group:
            states = [("gone",) if r not in live else
                      ("waits", self.open_posts[r][self.blocked[r]].label, self.open_posts[r][self.blocked[r]].op)
                      if r in self.blocked else ("finished",) for r in group]
            gone = [i for i, st in enumerate(states) if st[0] == "gone"]
            if gone:    # a peer's process ended: its death is the verdict, the waiting ranks its fallout
                for r in group:
                    if r in self.blocked:
                        self._fail(r, self.blocked[r], f"Connection closed by peer: rank {gone[0]}'s process ended "
                                   f"while this rank waited in {self.open_posts[r][self.blocked[r]].label}")
                continue
            msg = deadlock_message(states)
            self.deadlocked = self.deadlocked or msg
            self._event("deadlock", msg, [r for r in group if r in self.blocked])   # the verdict of the waiting
            for r in group:
                if r in self.blocked:
                    self._fail(r, self.blocked[r], msg, deadlock=True)

    # -- collectives -----------------------------------------------------------------------------------------
    def _post(self, post: Post):
        r, ranks = post.rank, post.ranks
        n = self.op_counts[(r, post.op)] = self.op_counts.get((r, post.op), 0) + 1
        post.label = f"{post.op} #{n} ({post.phase})"
        post.order = self.posted[r] = self.posted.get(r, 0) + 1
        self.open_posts.setdefault(r, {})[post.seq] = post
        if self.deadlocked:
            self._fail(r, post.seq, self.deadlocked, deadlock=True)
            return
        if r not in ranks:
            self._fail(r, post.seq, f"rank {r} posted a collective on a group it is not in")
            return
        if self.group is not None and not set(ranks) <= set(self.group):
            # ranks outside the item's group are not running it: such a collective could only wait
            self._fail(r, post.seq, f"{post.label} is on a group of {len(ranks)} ranks, but this check runs on "
                       f"{len(self.group)}, and the others are not in it: a collective on the default group (no "
                       "group=), or a group or mesh built from dist.get_world_size()? Use the group you are given.")
            return
        group = (post.header["group"], tuple(ranks))
        if post.op in P2P:
            self._post_p2p(post, group)
            return
        k = self.counters[(r, group)] = self.counters.get((r, group), 0) + 1
        slot = self.slots.setdefault((group, k), {})
        slot[r] = post
        if len(slot) == len(ranks):
            del self.slots[(group, k)]
            self._resolve(group, k, [slot[x] for x in ranks])

    def _answer(self, post: Post, tensors=(), **fields):
        """`fields`: more for the rank to know (a recv from any source: `src`, the sender's rank in the group)."""
        self.open_posts.get(post.rank, {}).pop(post.seq, None)
        if self.blocked.get(post.rank) == post.seq:
            del self.blocked[post.rank]
        self._send(post.rank, {"k": "done", "seq": post.seq, **fields}, tensors, post.room)

    def _fail(self, rank: int, seq: int, msg: str, deadlock: bool = False):
        self.open_posts.get(rank, {}).pop(seq, None)
        if self.blocked.get(rank) == seq:
            del self.blocked[rank]
        self._send(rank, {"k": "error", "seq": seq, "msg": msg, "deadlock": deadlock})

    def _record(self, post: Post, full_bytes: int, t: int, **extra):
        """One entry of `post.rank`'s record, appended when the collective completes. Besides the ledger's fields:
        `posted`, its place in the rank's program order (the rank posts one at a time); `members`, the group as
        places in the item's group (which of several sub-groups, a mesh's dp or tp); `peer`, a send's or recv's
        peer as a place in it. The rank says none of them: the switchboard counts and knows."""
        x = post.tensors[0] if post.tensors else None
        place = (lambda j: self.group.index(j) if j in self.group else -1) if self.group else (lambda j: j)
        entry = {"phase": post.phase, "op": post.op, "index": self.op_counts[(post.rank, post.op)],
                 "bytes": int(full_bytes), "dtype": str(x.dtype).removeprefix("torch.") if x is not None else "",
                 "shape": list(x.shape) if x is not None else [], "group": t,
                 "sent": float(ring_bytes_sent(post.op, full_bytes, t)), "posted": post.order,
                 "members": [place(j) for j in post.ranks], **extra}
        if post.op in P2P:
            entry["peer"] = place(post.peer)
        self._item()["entries"].setdefault(str(post.rank), []).append(entry)

    def _resolve(self, group, k: int, posts: list[Post]):
        problem = disagreement(posts)
        if problem:
            desc = "; ".join(f"rank {i}: {p.label}" for i, p in enumerate(posts))
            msg = (f"the ranks disagree on collective #{k} of their group ({problem}): {desc}. Every rank must "
                   "issue the same collectives, on tensors of the same shape, in the same order.")
            self._event("mismatch", msg, [p.rank for p in posts])
            for p in posts:
                self._fail(p.rank, p.seq, msg)
            return
        if posts[0].op not in REDUCING and any(p.room for p in posts):
            # an answer made of a rank's input (an all-gather's parts) must not be read from its arena once that rank
            # has its answer: it may write its next post there at once
            for p in posts:
                p.tensors = [x.clone() for x in p.tensors]
        for p, (answer, full_bytes, extra) in zip(posts, outcome(posts)):
            self._record(p, full_bytes, len(posts), **extra)
            self._answer(p, answer)

    def _post_p2p(self, post: Post, group):
        """Match a send with its recv: the same group, source, destination and tag, in the order they were posted. A
        recv from any source (`any_source`, peer -1) takes the earliest send posted to its rank with its tag, and
        learns from whom; a send goes to the earliest of the recvs that can take it."""
        any_source = post.op == "recv" and post.peer < 0 and post.header.get("any_source") is True
        if post.peer < 0 and not any_source:
            self._fail(post.rank, post.seq, f"{post.label}: no such rank in the group")
            return
        if post.peer == post.rank:
            self._fail(post.rank, post.seq, f"{post.label}: a rank cannot send to or receive from itself (gloo cannot "
                       "either): use the tensor you have (x.clone()) instead")
            return
        self._p2p_arrivals = getattr(self, "_p2p_arrivals", 0) + 1
        post.arrival = self._p2p_arrivals
        tag = int(post.header.get("tag", 0))
        if any_source:
            heads = [(q[0].arrival, key) for key, q in self.sends.items()
                     if q and key[0] == group and key[2] == post.rank and key[3] == tag]
            if not heads:
                self.recvs.setdefault((group, -1, post.rank, tag), deque()).append(post)
                return
            self._match_p2p(self.sends[min(heads)[1]].popleft(), post)
            return
        src, dst = (post.rank, post.peer) if post.op == "send" else (post.peer, post.rank)
        key = (group, src, dst, tag)
        if post.op == "recv":
            if self.sends.get(key):
                self._match_p2p(self.sends[key].popleft(), post)
            else:
                self.recvs.setdefault(key, deque()).append(post)
            return
        waiting = [q for q in (self.recvs.get(key), self.recvs.get((group, -1, dst, tag))) if q]
        if waiting:
            self._match_p2p(post, min(waiting, key=lambda q: q[0].arrival).popleft())
        else:
            self.sends.setdefault(key, deque()).append(post)

    def _match_p2p(self, send: Post, recv: Post):
        """A send and the recv that takes it: checked, recorded for both, answered."""
        want = [tuple(s) for s in recv.header.get("want", [])]
        got = [tuple(x.shape) for x in send.tensors]
        if [torch.Size(w).numel() for w in want] != [torch.Size(g).numel() for g in got]:
            msg = (f"{send.label} sends {got} but {recv.label} receives into {want}: a send and its recv must "
                   "have the same size.")
            self._event("mismatch", msg, [send.rank, recv.rank])
            self._fail(send.rank, send.seq, msg)
            self._fail(recv.rank, recv.seq, msg)
            return
        n = sum(nbytes(x) for x in send.tensors)
        t = len(send.ranks)
        any_source = recv.peer < 0
        recv.peer = send.rank                            # the record names the rank it came from
        self._record(send, n, t)
        self._record(recv, n, t, sent=0.0)
        # the recv first: the sender may reuse its arena as soon as it has its answer
        self._answer(recv, [x.reshape(w) for x, w in zip(send.tensors, want)],
                     **({"src": send.ranks.index(send.rank)} if any_source else {}))
        self._answer(send)

    # -- the record ------------------------------------------------------------------------------------------
    def write_record(self):
        # item -1: what happened before the first item began (a malformed message, say)
        data = json.dumps({"items": {str(k): v for k, v in self.record.items()}}).encode()
        tmp = os.path.join(self.record_dir, "comm.json.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.record_dir, "comm.json"))


def load_inputs(template: str, nproc: int) -> dict[int, dict]:
    """rank -> {item id: {name: tensor}} from the grader's per-rank input files (read by the launcher only)."""
    out = {}
    for r in range(nproc):
        path = template.format(rank=r)
        if os.path.exists(path):
            with open(path, "rb") as f:
                out[r] = torch.load(io.BytesIO(f.read()), weights_only=True)
    return out
