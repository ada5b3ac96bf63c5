"""What a rank can cost the trusted side, bounded outside its process.

Every frame on a rank's link to the switchboard is checked before anything reads it: a malformed, oversized or
out-of-range one (or one whose handling fails in any way) closes that rank's link with an event naming the rule,
which becomes the rank's verdict, and the launcher serves the other ranks on. What the launcher holds for a rank
(its frame being read, its collectives in flight, the answers it has not read, the results it hands over) is bounded
however it floods. A rank's out/ folder is a size-capped tmpfs: past the cap a write fails inside the rank, and the
verdict names the cap.

The switchboard's own tests drive a `Switchboard` in this process over socket pairs (each frame a rank could send,
in milliseconds); the rest run real launches."""
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import launch.switchboard as sb
from grader import ROOT
from launch.wire import ALIGN, ARENA_BYTES, HEAD, MAX_PAYLOAD, Arena, FrameReader, arena_layout, encode, \
    encode_shared

WORLD = 3


class Board:
    """A switchboard in this process; `socks[r]` is rank r's end of its link."""

    def __init__(self, tmp_path, nproc: int = WORLD, items: list | None = None, arenas: bool = False):
        """`arenas`: each rank has one (`arenas[r]`: the rank's own mapping of it, as `launch.course_pg` makes)."""
        self.sel = selectors.DefaultSelector()
        self.board = sb.Switchboard(self.sel, {}, items or [], str(tmp_path / "record"))
        self.socks, self.arenas = [], []
        for r in range(nproc):
            mine, theirs = socket.socketpair()
            arena = Arena.create(f"rank{r}") if arenas else None
            self.board.attach(r, mine, arena)
            self.socks.append(theirs)
            self.arenas.append(Arena(os.dup(arena.fd)) if arenas else None)

    def pump(self):
        """Serve the links until none is ready (a socket pair's bytes are there as soon as they are sent)."""
        for _ in range(10_000):
            ready = self.sel.select(timeout=0)
            if not ready:
                return
            for key, events in ready:
                self.board.on_ready(key.fd, events)

    def send(self, r: int, data: bytes):
        """What rank r writes, served as it goes (a frame larger than the socket's buffer included); stops where the
        switchboard closed the link."""
        sock, view = self.socks[r], memoryview(data)
        sock.setblocking(False)
        while view:
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                break
            self.pump()
        self.pump()

    def conn(self, r: int) -> sb.Conn:
        return next(c for c in self.board.conns.values() if c.rank == r)

    def events(self) -> list[dict]:
        return [ev for item in self.board.record.values() for ev in item["events"]]

    def answers(self, r: int, frames: bool = False) -> list:
        """Rank r's answers: their headers (`frames`: with their tensors, read from its arena where they are there)."""
        self.socks[r].setblocking(False)
        reader, out = FrameReader(self.arenas[r] if self.arenas else None), []
        while True:                 # what does not fit the socket's buffer is sent as the rank reads
            self.pump()
            try:
                chunk = self.socks[r].recv(1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            reader.feed(chunk)
        while (frame := reader.next_frame()) is not None:
            out.append(frame if frames else frame[0])
        return out


def raw(head: bytes, body: bytes = b"") -> bytes:
    return HEAD.pack(len(head), len(body)) + head + body


def op(**fields) -> dict:
    return {"k": "op", "seq": 1, "op": "all_reduce", "group": "0", "ranks": [0, 1, 2], "phase": "forward",
            "reduce": "sum", **fields}


def with_meta(tensors: list, header: dict | None = None, body: bytes = b"") -> bytes:
    return raw(json.dumps({**(header or {"k": "end", "index": 0}), "tensors": tensors}).encode(), body)


BAD_FRAMES = {
    # a header field of the wrong type or range: what used to raise OverflowError in the launcher and kill it
    "seq infinite": (encode({"k": "wait", "seq": float("inf")}), "`seq` is not a small integer"),
    "seq 1e999": (raw(b'{"k": "wait", "seq": 1e999}'), "`seq` is not a small integer"),
    "seq 2**70": (encode({"k": "wait", "seq": 2 ** 70}), "`seq` is not a small integer"),
    "seq negative": (encode({"k": "wait", "seq": -1}), "`seq` is not a small integer"),
    "seq a string": (encode({"k": "wait", "seq": "3"}), "`seq` is not a small integer"),
    "seq nested": (encode({"k": "wait", "seq": [[1], {"a": [2]}]}), "`seq` is not a small integer"),
    "seq a bool": (encode({"k": "wait", "seq": True}), "`seq` is not a small integer"),
    "seq missing": (encode({"k": "wait"}), "`seq` is not a small integer"),
    "index a float": (encode({"k": "begin", "index": 0.5}), "`index` is not a small integer"),
    "index skips ahead": (encode({"k": "begin", "index": 5}), "asked to begin item 5 during item -1"),
    "failed not a bool": (encode({"k": "end", "index": 0, "failed": "yes"}), "`failed` is not true or false"),
    "unknown kind": (encode({"k": "gimme"}), "`k` is not one of op, wait, begin, end"),
    "no kind": (encode({"seq": 1}), "`k` is not one of op, wait, begin, end"),
    # headers that are not what a header is
    "header a list": (raw(b"[1, 2]"), "the header is not a JSON object"),
    "header null": (raw(b"null"), "the header is not a JSON object"),
    "header cut short": (raw(b'{"k": '), "the header is not JSON"),
    "header nested past the parser": (raw(b"[" * 200_000 + b"]" * 200_000), "the header is not JSON"),
    "header not UTF-8": (raw(b"\xff\xfe{}"), "the header is not JSON"),
    "an integer of 5000 digits": (raw(b'{"k": "wait", "seq": ' + b"9" * 5000 + b"}"), "the header is not JSON"),
    # sizes over the limits, and tensor descriptions that are no tensor's
    "header over 1 MiB": (HEAD.pack(1 << 21, 0), "is over the limit"),
    "payload of 4 GiB": (HEAD.pack(2, (1 << 32) - 1) + b"{}", "is over the limit"),
    "tensors not a list": (raw(b'{"k": "end", "index": 0, "tensors": "x"}'), "`tensors` is not a list"),
    "too many tensors": (with_meta([{"dtype": "uint8", "shape": [0]}] * 1025), "`tensors` is not a list of at most"),
    "tensor not a dict": (with_meta([5]), "a tensor's description is not"),
    "quantized dtype": (with_meta([{"dtype": "qint8", "shape": [1]}], body=b"\0"), "dtype 'qint8' is not one"),
    "dtype no dtype": (with_meta([{"dtype": "__class__", "shape": [1]}], body=b"\0"), "is not one a collective"),
    "shape claiming 2**62 bytes": (with_meta([{"dtype": "uint8", "shape": [2 ** 62]}]), "shape is not a list of"),
    "shape empty yet huge": (with_meta([{"dtype": "uint8", "shape": [0, 2 ** 62]}]), "shape is not a list of"),
    "shape negative": (with_meta([{"dtype": "uint8", "shape": [-1]}]), "shape is not a list of"),
    "shape a float": (with_meta([{"dtype": "uint8", "shape": [1.5]}]), "shape is not a list of"),
    "shape of 17 dims": (with_meta([{"dtype": "uint8", "shape": [1] * 17}]), "shape is not a list of"),
    "payload short": (with_meta([{"dtype": "float32", "shape": [4]}], body=b"\0" * 8), "payload is shorter"),
    "payload long": (with_meta([{"dtype": "float32", "shape": [1]}], body=b"\0" * 8), "payload is longer"),
    # a collective's fields
    "op not a name": (encode(op(op=7), [torch.ones(1)]), "`op` is not a name"),
    "group not a name": (encode(op(group={"a": 1}), [torch.ones(1)]), "`group` is not a name"),
    "group name of 300 characters": (encode(op(group="g" * 300), [torch.ones(1)]), "`group` is not a name"),
    "rank beyond the job": (encode(op(ranks=[0, 7]), [torch.ones(1)]), "`ranks` is not a list of distinct ranks"),
    "rank twice": (encode(op(ranks=[0, 0]), [torch.ones(1)]), "`ranks` is not a list of distinct ranks"),
    "no ranks": (encode(op(ranks=[]), [torch.ones(1)]), "`ranks` is not a list of distinct ranks"),
    "ranks a string": (encode(op(ranks="01"), [torch.ones(1)]), "`ranks` is not a list of distinct ranks"),
    "peer infinite": (encode(op(op="send", peer=float("inf")), [torch.ones(1)]), "`peer` is not a small integer"),
    "tag a string": (encode(op(op="send", peer=1, tag="x"), [torch.ones(1)]), "`tag` is not a small integer"),
    "root huge": (encode(op(op="broadcast", root=2 ** 40), [torch.ones(1)]), "`root` is not a small integer"),
    "unknown reduce op": (encode(op(reduce="xor"), [torch.ones(1)]), "`reduce` is not one of"),
    "even not a bool": (encode(op(op="all_to_all", even="yes"), [torch.ones(1)] * 3), "`even` is not true or false"),
    "out_rows nested": (encode(op(op="all_to_all", out_rows=[[1]]), [torch.ones(1)] * 3), "`out_rows` is not a list"),
    "out_rows too long": (encode(op(op="all_to_all", out_rows=[1] * 4), [torch.ones(1)] * 3), "`out_rows` is not"),
    "want too big": (encode(op(op="recv", peer=1, want=[[2 ** 20, 2 ** 20]]), []), "`want` holds a shape"),
    "want not shapes": (encode(op(op="recv", peer=1, want=[[-1]]), []), "`want` holds a shape"),
    "all_gather of nothing": (encode(op(op="all_gather"), []), "an all_gather carries one tensor, not 0"),
}


@pytest.mark.parametrize("frame, rule", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_a_frame_that_breaks_a_rule_closes_that_ranks_link_and_names_the_rule(tmp_path, frame, rule):
    """Rank 1 sends the frame; the switchboard records why it closed rank 1's link and no more, and goes on
    carrying the collectives of ranks 0 and 2."""
    b = Board(tmp_path)
    b.send(1, frame)
    assert b.conn(1).gone and not b.conn(0).gone and not b.conn(2).gone
    assert len(b.conn(1).reader.buf) <= HEAD.size + (1 << 20)      # a frame's sizes are checked as they arrive
    [event] = b.events()
    assert event["kind"] == "protocol" and event["ranks"] == [1], event
    assert event["msg"].startswith("rank 1 ") and rule in event["msg"], event["msg"]
    for r in (0, 2):
        b.send(r, encode(op(ranks=[0, 2]), [torch.full((2,), float(r + 1))]))
    assert [a["k"] for a in b.answers(0)] == ["done"] and [a["k"] for a in b.answers(2)] == ["done"]


BIG = 1 << 16                                     # floats: 256 KiB, an arena payload (launch.wire.SHM_MIN)
SPAN = arena_layout([(torch.float32, [BIG])])[1]


def shared(arena: Arena, at: int, header: dict, tensors: list) -> bytes:
    return encode_shared(header, tensors, arena, at)


def test_an_arena_payload_is_answered_in_the_arena_and_recorded_like_any(tmp_path):
    """Three ranks all-reduce 256 KiB through their arenas: each answer is in the rank's own arena, where it posted,
    and the record counts the same bytes as for a payload on the socket."""
    b = Board(tmp_path, arenas=True)
    for r in range(WORLD):
        b.send(r, shared(b.arenas[r], 128 * r, op(room=SPAN), [torch.full((BIG,), float(r + 1))]))
    for r in range(WORLD):
        [(header, [answer])] = b.answers(r, frames=True)
        assert header["k"] == "done" and header["shm"] == 128 * r and torch.equal(answer, torch.full((BIG,), 6.0))
        assert answer.data_ptr() == b.arenas[r].bytes[128 * r:].data_ptr()
    [entry] = b.board.record[-1]["entries"]["0"]
    assert entry["bytes"] == 4 * BIG and entry["shape"] == [BIG]


def test_an_answer_larger_than_the_room_the_rank_reserved_comes_on_the_socket(tmp_path):
    """An all-gather whose post reserved room for its input only: the gathered answer travels on the socket."""
    b = Board(tmp_path, arenas=True)
    for r in range(WORLD):
        b.send(r, shared(b.arenas[r], 0, op(op="all_gather", room=SPAN), [torch.full((BIG,), float(r))]))
    for r in range(WORLD):
        [(header, parts)] = b.answers(r, frames=True)
        assert "shm" not in header and [float(p[0]) for p in parts] == [0.0, 1.0, 2.0]


ARENA_FRAMES = {
    "outside the arena": (dict(shm=ARENA_BYTES - ALIGN, room=SPAN), "not inside the rank's 256 MiB arena"),
    "negative offset": (dict(shm=-ALIGN, room=SPAN), "not inside the rank's"),
    "misaligned": (dict(shm=3, room=SPAN), "or not 64-byte aligned"),
    "offset a string": (dict(shm="0", room=SPAN), "not inside the rank's"),
    "offset a bool": (dict(shm=True, room=SPAN), "not inside the rank's"),
    "no room": (dict(shm=0), "`room` is not a small integer"),
    "room too small": (dict(shm=0, room=SPAN - ALIGN), "`room` is smaller than the tensors"),
    "sparse": (dict(shm=0, room=SPAN, sparse=[BIG]), "a sparse tensor in the arena"),
}


@pytest.mark.parametrize("fields, rule", list(ARENA_FRAMES.values()), ids=list(ARENA_FRAMES))
def test_an_arena_payload_that_breaks_a_rule_closes_that_ranks_link(tmp_path, fields, rule):
    b = Board(tmp_path, arenas=True)
    b.arenas[1].write(0, [torch.ones(BIG)])
    head = json.dumps({**op(**fields), "tensors": [{"dtype": "float32", "shape": [BIG]}]}).encode()
    b.send(1, raw(head))
    [event] = b.events()
    assert event["ranks"] == [1] and rule in event["msg"], event["msg"]
    assert b.conn(1).gone and not b.conn(0).gone


def test_no_arena_payload_from_a_rank_without_one_or_with_bytes_on_the_socket_too(tmp_path):
    meta = [{"dtype": "float32", "shape": [4]}]
    for arenas, body in ((False, b""), (True, bytes(16))):
        b = Board(tmp_path / str(arenas), arenas=arenas)
        b.send(1, raw(json.dumps({**op(shm=0, room=SPAN), "tensors": meta}).encode(), body))
        [event] = b.events()
        assert "an arena payload from a rank without an arena, or with bytes on the socket too" in event["msg"]


def test_a_rank_cannot_resize_its_arena_under_the_launcher(tmp_path):
    """Shrunk, the launcher's next read of it would end in SIGBUS: the arena is sealed at its size."""
    arena = Arena.create("rank0")
    for size in (0, ARENA_BYTES // 2, ARENA_BYTES * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(arena.fd, size)
    assert os.fstat(arena.fd).st_size == ARENA_BYTES


def test_whatever_fails_while_a_frame_is_handled_is_the_senders_doing(tmp_path, monkeypatch):
    """Not only the rules listed: an exception of any kind raised while the switchboard carries out a rank's frame
    closes that rank's link, with the exception named, and the launcher goes on."""
    class Unforeseen(Exception):
        pass

    def disagreement(posts):
        raise Unforeseen("nobody saw this coming")
    monkeypatch.setattr(sb, "disagreement", disagreement)
    b = Board(tmp_path)
    b.send(0, encode(op(ranks=[0, 1]), [torch.ones(2)]))
    b.send(1, encode(op(ranks=[0, 1]), [torch.ones(2)]))     # the group is complete: carried out on rank 1's frame
    [event] = b.events()
    assert event["ranks"] == [1] and "Unforeseen: nobody saw this coming" in event["msg"], event
    assert b.conn(1).gone and not b.conn(0).gone
    b.send(2, encode({"k": "begin", "index": 0}))
    b.send(0, encode({"k": "begin", "index": 0}))
    assert [a["k"] for a in b.answers(2)] == ["start"]


def test_a_frames_bytes_before_a_bad_one_count_however_they_were_chunked(tmp_path):
    """A rank's result handed over just before a malformed frame is kept whether both came in one read or two:
    frames are decoded one at a time, in order, so a grade never depends on how the bytes arrived."""
    for together in (True, False):
        b = Board(tmp_path / str(together), nproc=1, items=[{"id": "a", "group": None}])
        b.send(0, encode({"k": "begin", "index": 0}))
        result, bad = encode({"k": "end", "index": 0}, [torch.arange(5, dtype=torch.uint8)]), raw(b"[]")
        if together:
            b.send(0, result + bad)
        else:
            b.send(0, result)
            b.send(0, bad)
        assert b.conn(0).gone
        assert (tmp_path / str(together) / "record" / "rank0" / "0.pt").read_bytes() == bytes(range(5))


def test_a_rank_cannot_make_the_launcher_hold_its_collectives_without_bound(tmp_path, monkeypatch):
    """Collectives posted and not matched by the peers are held by the switchboard: at most MAX_IN_FLIGHT of them,
    and MAX_HELD bytes, a rank; the one beyond closes its link and says how to stay within."""
    b = Board(tmp_path)
    for seq in range(1, sb.MAX_IN_FLIGHT + 2):
        b.send(0, encode(op(op="send", seq=seq, ranks=[0, 1], peer=1)))
    [event] = b.events()
    assert event["ranks"] == [0] and f"posted {sb.MAX_IN_FLIGHT} collectives" in event["msg"], event
    assert "work.wait()" in event["msg"]
    monkeypatch.setattr(sb, "MAX_HELD", 1 << 20)
    b = Board(tmp_path / "bytes")
    for seq in (1, 2, 3):
        b.send(2, encode(op(op="send", seq=seq, ranks=[1, 2], peer=0), [torch.zeros(1 << 17)]))   # 512 KiB each
    assert b.conn(2).gone and len(b.board.open_posts[2]) == 2
    [event] = b.events()
    assert event["ranks"] == [2] and "(or 1 MiB)" in event["msg"] and b.conn(2).gone


def test_a_rank_that_does_not_read_its_answers_is_not_read_either(tmp_path, monkeypatch):
    """Two ranks post all-gathers and read none of the answers: once a rank's unread answers pass MAX_BACKLOG the
    switchboard stops reading its socket (its sends then block), so what the launcher buffers for it stays bounded;
    when it reads again, everything it posted is carried out."""
    monkeypatch.setattr(sb, "MAX_BACKLOG", 256 << 10)
    b = Board(tmp_path, nproc=2)
    for s in b.socks:
        s.setblocking(False)
    posts, pending, most = 400, [bytearray(), bytearray()], 0
    frames = [encode(op(op="all_gather", seq=seq, ranks=[0, 1]), [torch.zeros(1 << 14)]) for seq in range(1, posts + 1)]
    for frame in frames:                                      # 400 posts of 64 KiB: 50 MiB of answers
        for r in (0, 1):
            pending[r] += frame
            try:
                del pending[r][:b.socks[r].send(pending[r])]
            except BlockingIOError:
                pass
        b.pump()
        most = max(most, len(b.conn(0).out), len(b.conn(1).out))
    # past the backlog, only the answers to what was read in one go (a socket buffer's worth): not 50 MiB
    answer = len(encode({"k": "done", "seq": posts}, [torch.zeros(1 << 14)] * 2))
    assert most <= sb.MAX_BACKLOG + 16 * answer, most
    assert pending[0] and pending[1], "the switchboard read on although its answers went unread"
    done = [0, 0]
    readers = [FrameReader(), FrameReader()]
    for _ in range(10_000):
        for r in (0, 1):
            try:
                while chunk := b.socks[r].recv(1 << 20):
                    readers[r].feed(chunk)
            except BlockingIOError:
                pass
            while readers[r].next_frame() is not None:
                done[r] += 1
            if pending[r]:
                try:
                    del pending[r][:b.socks[r].send(pending[r])]
                except BlockingIOError:
                    pass
        b.pump()
        if done == [posts, posts]:
            break
    assert done == [posts, posts] and not b.events()


def test_a_rank_cannot_hand_over_more_results_than_the_grader_reads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "MAX_RESULTS", 1 << 20)
    b = Board(tmp_path, nproc=1, items=[{"id": "a", "group": None}, {"id": "b", "group": None}])
    for index in (0, 1):
        b.send(0, encode({"k": "begin", "index": index}))
        b.send(0, encode({"k": "end", "index": index}, [torch.zeros(600 << 10, dtype=torch.uint8)]))
    [event] = b.events()
    assert "handed over more than 1 MiB of results" in event["msg"] and b.conn(0).gone
    assert (tmp_path / "record" / "rank0" / "0.pt").exists() and not (tmp_path / "record" / "rank0" / "1.pt").exists()


def test_a_rank_cannot_grow_the_record_without_bound(tmp_path, monkeypatch):
    """Every collective a rank posts is recorded: past MAX_RECORDED in one launch (here 50), its link is closed, and
    what the record holds for it stops there (a largest record is what the grader reads back,
    grader.judge.attempt.COMM_LIMIT: 16k entries of 8 ranks at their largest)."""
    from grader.judge.attempt import COMM_LIMIT
    assert 8 * sb.MAX_RECORDED * 400 < COMM_LIMIT
    monkeypatch.setattr(sb, "MAX_RECORDED", 50)
    b = Board(tmp_path, nproc=1)
    for seq in range(1, 60):
        b.send(0, encode(op(seq=seq, op="barrier", ranks=[0]), []))
    [event] = b.events()
    assert "posted more than 50 collectives in one launch" in event["msg"] and b.conn(0).gone
    assert len(b.board.record[-1]["entries"]["0"]) == 50


def test_the_launcher_survives_a_malformed_message_and_serves_the_rest(tmp_path):
    """Through a real launcher (`python -m launch.forkrun`, as grading runs it): rank 1 sends `wait` with seq 1e999,
    rank 2 a tensor claiming 2**62 bytes; the launcher records both, rank 0 goes on alone, and the launcher ends
    with every rank's status."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import os, time, torch, torch.distributed as dist
        from launch import course_pg
        course_pg.register()
        r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("course", store=dist.HashStore(), rank=r, world_size=n)
        link = course_pg.link()
        link.request({"k": "begin", "index": 0})
        raw = lambda head: len(head).to_bytes(4, "little") + bytes(4) + head
        if r == 1:
            link.sock.sendall(raw(b'{"k": "wait", "seq": 1e999}'))
        elif r == 2:
            link.sock.sendall(raw(b'{"k": "end", "index": 0, "tensors": [{"dtype": "uint8", "shape": [%d]}]}'
                                  % 2 ** 62))
        else:
            link.request({"k": "begin", "index": 1})
            print("RANK 0 SERVED", flush=True)
        time.sleep(0.5)
    """))
    env = {**os.environ, "PYTHONPATH": ROOT, "COURSE_SWITCHBOARD": str(tmp_path / "record"), "OMP_NUM_THREADS": "1",
           "COURSE_ITEMS": "[]"}
    p = subprocess.run([sys.executable, "-m", "launch.forkrun", "--nproc", "3", str(script)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert "RANK 0 SERVED" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    status = json.loads(p.stdout.split("@@status ", 1)[1].splitlines()[0])
    assert status["exitcodes"] == {"0": 0, "1": 0, "2": 0}, p.stdout[-3000:]
    events = json.loads((tmp_path / "record" / "comm.json").read_text())["items"]["0"]["events"]
    said = {ev["ranks"][0]: ev["msg"] for ev in events if ev["kind"] == "protocol"}
    assert said.keys() == {1, 2}, events
    assert said[1].startswith("rank 1 sent a malformed message: `seq` is not a small integer ("), said
    assert said[2].startswith(f"rank 2 sent a malformed message: a tensor's shape is not a list of at most 16 sizes "
                              f"from 0 to {MAX_PAYLOAD} ("), said
    assert all(m.endswith("The switchboard closed its link.") for m in said.values()), said


@pytest.fixture()
def job_folders(tmp_path, monkeypatch):
    """Where this test's grading jobs make their folders (tempfile's), and so their mounts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def mounts_under(folder) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" {folder}/" in line]


needs_box = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                               reason="needs bubblewrap and root (the ranks' isolation and their capped out/)")

SEND_AT_IMPORT = """
import json as _json, os as _os
from launch import course_pg as _cp
if _os.environ["RANK"] == "3":      # job rank 3: rank 1 of the t=2 item (the job's last two ranks run it)
    _head = b'{"k": "wait", "seq": 1e999}'
    _cp.link().sock.sendall(len(_head).to_bytes(4, "little") + bytes(4) + _head)
"""


@needs_box
def test_a_malformed_message_is_the_verdict_of_the_rank_that_sent_it(job_folders):
    """Graded: the rank that sent it is told what was wrong with its message (not that it stopped while importing),
    its peer that it was left waiting because of it."""
    from grader.judge.job import run_checks
    from grader.tools.corpus import solution_modules
    module = solution_modules("week02")["tp_linear.py"]
    rep = run_checks(["week02/column_parallel"], {"tp_linear.py": SEND_AT_IMPORT + module}, sandbox="on")
    msg = rep.cases["week02/column_parallel"].message()
    assert "[t=2] rank 1 sent a malformed message: `seq` is not a small integer" in msg, msg
    assert "importing" not in msg and "rank 0: left waiting" in msg, msg
    assert not mounts_under(job_folders)


FILL_OUT = """
import os as _os
_fd, _wrote = _os.open("fill.bin", _os.O_WRONLY | _os.O_CREAT), 0
try:
    while True:          # 8 MiB at a time, below the 64 MiB a single file may have (RLIMIT_FSIZE)
        _wrote += _os.write(_fd, bytes(8 << 20))
        if _wrote >= 40 << 20:
            _os.close(_fd)
            _fd = _os.open(f"fill{_wrote}.bin", _os.O_WRONLY | _os.O_CREAT)
except OSError as _e:
    raise OSError(_e.errno, f"{_e.strerror} after {_wrote >> 20} MiB") from None
"""


@needs_box
@pytest.mark.parametrize("job_mib, rank_mib", [(256, 64), (1024, 128)], ids=["job cap", "rank cap"])
def test_a_ranks_out_folder_has_a_total_cap(monkeypatch, job_folders, job_mib, rank_mib):
    """Every rank of a 4-rank job writes files into out/ until a write fails: each gets min(128 MiB a rank, the
    job's 256 MiB / 4), a tmpfs, so the grader's disk never holds them; the write fails with ENOSPC inside the rank
    and the verdict names the cap. Nothing stays mounted."""
    import functools
    from grader.box.sandbox import Limits, Sandbox
    from grader.judge import attempt
    from grader.judge.job import run_checks
    from grader.tools.corpus import solution_modules
    monkeypatch.setattr(attempt, "Sandbox", functools.partial(Sandbox, limits=Limits(job_out_bytes=job_mib << 20)))
    module = solution_modules("week02")["tp_linear.py"]
    rep = run_checks(["week02/column_parallel"], {"tp_linear.py": FILL_OUT + module}, sandbox="on")
    msg = rep.cases["week02/column_parallel"].message()
    wrote = {int(x.split(" MiB")[0]) for x in msg.split("No space left on device after ")[1:]}
    assert wrote and all(rank_mib - 2 <= w < rank_mib for w in wrote), msg
    assert f"its out/ folder is full: {rank_mib} MiB, what a rank of this job may write there (128 MiB a rank, " \
           f"{job_mib} MiB the job's ranks together)" in msg, msg
    assert not mounts_under(job_folders) and os.listdir(job_folders) == []
