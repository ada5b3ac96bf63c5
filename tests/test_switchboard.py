"""The switchboard (launch/switchboard.py): the launcher carries out and records every collective of its ranks.

Each test runs a small program on ranks of `python -m launch.forkrun` with COURSE_SWITCHBOARD set, as grading
does, and reads what the switchboard wrote (comm.json) besides what the ranks printed."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from grader import ROOT

PRELUDE = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from launch import course_pg
    course_pg.register()
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("course", store=dist.HashStore(), rank=r, world_size=n)
    link = course_pg.link()

    def begin(i):
        link.request({"k": "begin", "index": i})
""")


def run_ranks(tmp_path, body: str, nproc: int = 2, timeout: float = 60.0, items: list[dict] | None = None):
    """`items`: the job's items as grading hands them over (id, the job ranks that run it); none by default."""
    script = tmp_path / "prog.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": ROOT, "COURSE_SWITCHBOARD": str(tmp_path / "record"), "OMP_NUM_THREADS": "1",
           "COURSE_ITEMS": json.dumps(items or [])}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "launch.forkrun", "--nproc", str(nproc), str(script)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    record = json.loads((tmp_path / "record" / "comm.json").read_text())["items"]
    return p, record, time.monotonic() - t0


def test_every_collective_gives_torchs_answer_and_is_recorded(tmp_path):
    """dist.* calls, an async op, the list forms and functional collectives (DTensor's) on 3 ranks: every
    rank gets what gloo would give it, and the switchboard records each call with its bytes."""
    p, record, _ = run_ranks(tmp_path, """
        begin(0)
        x = torch.arange(6.) + 10 * r                                          # (6,)
        want_sum = sum(torch.arange(6.) + 10 * i for i in range(n))
        y = x.clone(); dist.all_reduce(y); assert torch.equal(y, want_sum)
        y = x.clone(); dist.all_reduce(y, op=dist.ReduceOp.MAX); assert torch.equal(y, torch.arange(6.) + 10 * (n - 1))
        g = torch.empty(6 * n); dist.all_gather_into_tensor(g, x)
        assert torch.equal(g, torch.cat([torch.arange(6.) + 10 * i for i in range(n)]))
        gl = [torch.empty(6) for _ in range(n)]; dist.all_gather(gl, x); assert torch.equal(torch.cat(gl), g)
        o = torch.empty(2); dist.reduce_scatter_tensor(o, x)
        assert torch.equal(o, want_sum[2 * r:2 * r + 2])
        w = dist.all_reduce(y := x.clone(), async_op=True); w.wait(); assert torch.equal(y, want_sum)
        a = torch.empty(6); dist.all_to_all_single(a, x)                      # rank j gets rows 2j:2j+2 of all
        assert torch.equal(a, torch.cat([(torch.arange(6.) + 10 * i)[2 * r:2 * r + 2] for i in range(n)]))
        b = x.clone(); dist.broadcast(b, src=1); assert torch.equal(b, torch.arange(6.) + 10)
        dist.barrier()
        if r == 0:
            dist.send(torch.ones(3), 2)
        elif r == 2:
            z = torch.zeros(3); dist.recv(z, 0); assert torch.equal(z, torch.ones(3))
        assert torch.equal(fc.all_reduce(x, "sum", dist.group.WORLD) + 0, want_sum)
        assert torch.equal(fc.all_gather_tensor(x, 0, dist.group.WORLD) + 0, g)
        assert torch.equal(fc.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) + 0, want_sum[2 * r:2 * r + 2])
        print("ALL OK", flush=True)
        begin(1)
    """, nproc=3)
    assert p.returncode == 0 and p.stdout.count("ALL OK") == 3, p.stdout[-3000:]
    ops = [(e["op"], e["bytes"], e.get("reduce")) for e in record["0"]["entries"]["0"]]
    assert ops == [("all_reduce", 24, "sum"), ("all_reduce", 24, "max"), ("all_gather", 72, None),
                   ("all_gather", 72, None), ("reduce_scatter", 24, "sum"), ("all_reduce", 24, "sum"),
                   ("all_to_all", 24, None), ("broadcast", 24, None), ("barrier", 0, None), ("send", 12, None),
                   ("all_reduce", 24, "sum"), ("all_gather", 72, None), ("reduce_scatter", 24, "sum")]
    assert [e["op"] for e in record["0"]["entries"]["2"]].count("recv") == 1
    assert record["0"]["events"] == []


def test_a_deadlock_is_judged_at_once_and_the_next_item_runs_in_the_same_ranks(tmp_path):
    """Both ranks block in a send no one receives (sends wait for their recv, as NCCL's do): the switchboard
    sees every rank blocked and answers both waits with the picture, in well under a second; the ranks go
    on to the next item, whose collectives are not matched with the stuck ones."""
    p, record, seconds = run_ranks(tmp_path, """
        from launch.course_pg import Deadlock
        begin(0)
        t0 = time.monotonic()
        try:
            dist.send(torch.ones(2), 1 - r)
        except Deadlock as exc:
            print(f"JUDGED after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
        begin(1)
        y = torch.ones(2); dist.all_reduce(y); assert torch.equal(y, 2 * torch.ones(2))
        print("NEXT OK", flush=True)
        begin(2)
    """)
    assert p.returncode == 0 and p.stdout.count("NEXT OK") == 2, p.stdout[-3000:]
    judged = [float(ln.split("after ")[1].split(" s")[0]) for ln in p.stdout.splitlines() if "JUDGED" in ln]
    assert len(judged) == 2 and max(judged) < 1.0, p.stdout
    assert "deadlock: rank 0 waits in send #1 (setup); rank 1 waits in send #1 (setup)" in p.stdout
    assert [ev["kind"] for ev in record["0"]["events"]] == ["deadlock"] and record["0"]["events"][0]["ranks"] == [0, 1]
    assert record["1"]["events"] == [] and [e["op"] for e in record["1"]["entries"]["0"]] == ["all_reduce"]


def test_ranks_that_disagree_on_a_collective_are_told_which_and_how(tmp_path):
    """Rank 0 all-reduces what rank 1 all-gathers: both get an error naming the two calls, and the item records
    a mismatch (gloo would hang, or abort the process)."""
    p, record, _ = run_ranks(tmp_path, """
        begin(0)
        try:
            if r == 0:
                dist.all_reduce(torch.ones(4))
            else:
                dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
        except RuntimeError as exc:
            print(f"TOLD {exc}", flush=True)
        begin(1)
    """)
    assert p.stdout.count("TOLD the ranks disagree on collective #1 of their group (different collectives): "
                          "rank 0: all_reduce #1 (setup); rank 1: all_gather #1 (setup)") == 2, p.stdout[-3000:]
    assert [ev["kind"] for ev in record["0"]["events"]] == ["mismatch"]


def test_a_collective_beyond_the_items_group_is_refused_at_once(tmp_path):
    """An item of size 2 on a 3-rank job runs on ranks 1 and 2 (grader.rank.exchange.participants); rank 0 sits it
    out. An all-reduce on the default group there could only wait for rank 0: both ranks are told at once why.
    Which ranks run the item is the job's list, not what a rank says."""
    p, record, _ = run_ranks(tmp_path, """
        link.request({"k": "begin", "index": 0, "group": [0, 1, 2]})     # a rank's word on its group is not heard
        if r:
            try:
                dist.all_reduce(torch.ones(4))
            except RuntimeError as exc:
                print(f"TOLD {exc}", flush=True)
        begin(1)
    """, nproc=3, items=[{"id": "w/c@t2", "group": [1, 2]}])
    assert p.stdout.count("TOLD all_reduce #1 (setup) is on a group of 3 ranks, but this check runs on 2, and the "
                          "others are not in it") == 2, p.stdout[-3000:]
    assert record["0"]["entries"] == {} and record["0"]["events"] == []


def test_a_result_handed_over_is_kept_and_cannot_be_replaced(tmp_path):
    """What a rank hands over at an item's end is stored at once; a second hand-over of the same item, or one
    for an item that is not the current one, is ignored."""
    p, _, _ = run_ranks(tmp_path, """
        begin(0)
        link.tell({"k": "end", "index": 0}, [torch.tensor([1, 2, 3], dtype=torch.uint8)])
        link.tell({"k": "end", "index": 0}, [torch.tensor([9, 9, 9], dtype=torch.uint8)])
        begin(1)
        link.tell({"k": "end", "index": 0}, [torch.tensor([7], dtype=torch.uint8)])
        begin(2)
    """)
    assert p.returncode == 0, p.stdout[-3000:]
    for r in range(2):
        assert (tmp_path / "record" / f"rank{r}" / "0.pt").read_bytes() == bytes([1, 2, 3])
        assert not (tmp_path / "record" / f"rank{r}" / "1.pt").exists()


@pytest.mark.parametrize("frame", [b"\xff" * 8, (10).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"not json!!"])
def test_a_malformed_message_closes_that_ranks_link_and_nothing_else(tmp_path, frame):
    """Garbage on a rank's socket is a protocol event for that rank; the launcher goes on and ends normally."""
    p, record, _ = run_ranks(tmp_path, f"""
        begin(0)
        if r == 1:
            link.sock.sendall({frame!r})
            time.sleep(0.5)
            os._exit(0)
        try:
            dist.all_reduce(torch.ones(1))
        except BaseException as exc:
            print("PEER GONE", type(exc).__name__, flush=True)
    """)
    assert "@@status" in p.stdout and "PEER GONE" in p.stdout, p.stdout[-3000:]
    assert [ev["kind"] for ev in record["0"]["events"]] == ["protocol"]


def test_a_rank_cannot_ask_for_a_later_items_inputs(tmp_path):
    """Items come in the job's order: a rank asking to begin any other item (to see a later item's inputs early)
    loses its link; which item's inputs a rank gets is the switchboard's choice, never the rank's."""
    p, record, _ = run_ranks(tmp_path, """
        if r == 1:
            link.tell({"k": "begin", "index": 3})
            time.sleep(0.5)
            os._exit(0)
        begin(0)
        print("RANK 0 BEGAN", flush=True)
    """)
    assert "RANK 0 BEGAN" in p.stdout, p.stdout[-3000:]
    assert [ev["kind"] for ev in record["-1"]["events"]] == ["protocol"]       # before the first item began
