"""Build a job folder, run it on N ranks, compare in this (trusted) process.

    JOBDIR/inputs/rank{r}.pt         what job rank r receives per item (the case's `rank_inputs`), made here
    JOBDIR/student/*.py              the student's modules (a snapshot: the kernel or the notebook JSON)
    JOBDIR/attemptK/spec.json        the items of launch K (case, t, config, run function), timeouts; no seed
    JOBDIR/attemptK/out/rank{r}.pt   written by each rank: tensors, ledger, parameter shapes, errors
    JOBDIR/attemptK/out/rank{r}.progress   where each rank is (which item, which collective)
Inside the sandbox JOBDIR is read-only and attemptK/out/ is the only folder a rank can write. Launch 0
runs every item; a later launch runs, in fresh ranks, the items after one in which a rank process died.

The launches themselves (sandbox, launcher, reading results back) are `grader.judge.attempt`; the time limits,
`grader.judge.timeouts`.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch

from grader.judge.attempt import Attempt
from grader.judge.case import get_case
from grader.judge.compare import ItemVerdict, compare_item, is_comm_error, rank_list
from grader.rank.exchange import DEADLOCKED, Item, JobSpec, RankRecord, failed_with, participants, world_of
from grader.judge.timeouts import ITEM_TIMEOUT, PG_TIMEOUT, job_wall_clock


class GraderCannotRun(RuntimeError):
    """The harness itself failed (no rank started): nothing may be graded from such a run."""


@dataclass
class CaseVerdict:
    name: str
    passed: bool
    items: list[ItemVerdict] = field(default_factory=list)

    def _said_once(self, kind: str) -> list[str]:
        """`kind` ("problems" or "notes") of every size, each said once: "[t=2, 4] all ranks: ..." rather than
        eight copies."""
        groups: dict[str, list[tuple[int, str]]] = {}
        sizes: dict[int, int] = {it.t: it.t for it in self.items}
        for it in self.items:
            for p in getattr(it, kind):
                m = re.match(r"rank (\d+)(.*)", p, re.S)
                key, who = ("rank *" + m.group(2), m.group(1)) if m else (p, "")
                groups.setdefault(key, []).append((it.t, who))
        said = []
        for key, hits in groups.items():
            ts = sorted({t for t, _ in hits})
            if not any(w for _, w in hits):
                said.append(f"[t={', '.join(map(str, ts))}] {key}")
                continue
            by_t: dict[int, set] = {}
            for t, w in hits:
                by_t.setdefault(t, set()).add(int(w))
            who = {t: "all ranks" if len(by_t[t]) == sizes[t] else rank_list(by_t[t]) for t in ts}
            if len(set(who.values())) == 1:      # the same ranks at every size: "[t=2, 4] rank 1: ..."
                head_ = f"[t={', '.join(map(str, ts))}] {who[ts[0]]}"
            else:                                # "[t=2] rank 1, [t=4] rank 3: ..."
                head_ = ", ".join(f"[t={t}] {who[t]}" for t in ts)
            said.append(head_ + key[len("rank *"):])
        return said

    def message(self, limit: int = 6) -> str:
        """The problems that failed this check, then its notes."""
        probs = self._said_once("problems")
        head = f"{self.name}: FAILED"
        body = "\n".join(f"  - {p}".replace("\n", "\n    ") for p in probs[:limit])
        more = f"\n  ... and {len(probs) - limit} more problem(s) of the same check." if len(probs) > limit else ""
        notes = self.notes(limit)
        return f"{head}\n{body}{more}" + (f"\n{notes}" if notes else "")

    def notes(self, limit: int = 6) -> str:
        """What the harness saw inside the student's process (the rank's own word): feedback that scores nothing."""
        said = self._said_once("notes")
        if not said:
            return ""
        lines = "\n".join(f"  - {n}".replace("\n", "\n    ") for n in said[:limit])
        return f"{self.name}: note (seen inside your process, not scored):\n{lines}"


@dataclass
class Report:
    cases: dict[str, CaseVerdict]
    seconds: float
    runs: list = field(default_factory=list)      # one launch, or more after a rank died (launch.RunResult)
    sandbox: dict = field(default_factory=dict)   # the box's description: its notes say what it could not do

    @property
    def run(self):
        return self.runs[-1] if self.runs else None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases.values())

    def table(self, names: list[str] | None = None, footer: bool = True) -> str:
        """One row per check and size (of `names`, default all): result, max |err|, communication; then how it ran."""
        rows = [f"{'check':<42} {'t':>3} {'result':<6} {'max|err|':>9}  communication (per rank)"]
        for c in self.cases.values():
            if names is not None and c.name not in names:
                continue
            for it in c.items:
                res = "PASS" if it.passed else "FAIL"
                err = f"{it.max_err:.1e}" if it.passed else "-"
                rows.append(f"{c.name:<42} {it.t:>3} {res:<6} {err:>9}  {it.comm}")
        if footer:
            rows.append(self.footer())
        return "\n".join(rows)

    def footer(self) -> str:
        backend = getattr(self.run, "backend", "?")
        launcher = getattr(self.run, "launcher", "?")
        return f"({backend}, {launcher} launcher, {self.seconds:.1f} s)"

    def cell_verdict(self, names: list[str]) -> tuple[bool, str]:
        """One grade cell's checks: (passed, its table) or (failed, each failed check's message); then the notes
        of its passed checks."""
        cases = [self.cases[n] for n in names if n in self.cases]
        failed = [c for c in cases if not c.passed]
        notes = [c.notes() for c in cases if c.passed and c.notes()]
        text = "\n".join(c.message() for c in failed) if failed else self.table(names, footer=False)
        return not failed, "\n".join([text] + notes)


def rank_views(items: list[Item], inputs: dict) -> list[dict]:
    """Per job rank, {item id: what that rank receives}: the case's `rank_inputs` for its rank in its group,
    or the full inputs for a case that has none."""
    world = world_of(items)
    views: list[dict] = [{} for _ in range(world)]
    for it in items:
        case = get_case(it.case)
        for r, j in enumerate(participants(it.t, world)):       # r: its rank in the group
            full = {k: v.clone() for k, v in inputs[it.id].items()}
            views[j][it.id] = case.rank_inputs(it.config, full, r, it.t) if case.rank_inputs else full
    return views


MAX_RANKS_ENV = "COURSE_MAX_RANKS"   # the most ranks this machine runs (a GPU node with fewer GPUs: gpu-check)


def runnable_sizes(world_sizes, max_ranks: int | None) -> tuple[int, ...]:
    """A case's sizes up to `max_ranks`; all of them when none fits (the launch then says why it cannot run)."""
    return tuple(t for t in world_sizes if max_ranks is None or t <= max_ranks) or tuple(world_sizes)


def plan_items(names: list[str]) -> list[Item]:
    max_ranks = int(os.environ[MAX_RANKS_ENV]) if os.environ.get(MAX_RANKS_ENV) else None
    items = []
    for name in names:
        case = get_case(name)
        items += [Item(id=f"{name}@t{t}", case=name, module=case.module, run_rank=case.run_rank, t=t,
                       config=case.config, timeout=case.timeout or ITEM_TIMEOUT)
                  for t in runnable_sizes(case.world_sizes, max_ranks)]
    return items


def draw_seeds(items: list[Item], fresh_seed: bool = True) -> dict[str, int]:
    """Each item's input seed, kept in this process. Graded: drawn fresh for every case, public ones too (a public
    case's fixed seed is a key its student could hard-code); `fresh_seed=False` (tests): the case's own seed.
    32 bits: torch's CPU generator keeps only the low 32 bits of a seed, so more would only look stronger."""
    by_case: dict[str, int] = {}       # one draw per case: its sizes see the same tensors
    for it in items:
        seed = get_case(it.case).seed
        by_case.setdefault(it.case, secrets.randbits(32) if fresh_seed else 12345 if seed is None else seed)
    return {it.id: by_case[it.case] for it in items}


# c10d's own socket warnings: noise in a student's "last output"
_C10D_NOISE = re.compile(r"\[c10d\]|socket\.cpp|ProcessGroupGloo\.cpp")


def _missing_reason(job_rank: int, item: Item, run, progress: dict, finished_by: list[int], group: list[int]) -> str:
    """Why a rank has no result for `item`: how its process ended, and where it was then. `group`: the job ranks
    that ran the item (participants), whose places name them."""
    label = group.index(job_rank)
    code = run.exitcodes.get(job_rank) if run is not None else None
    here = progress.get(job_rank) or {}
    others = f"; {rank_list(group.index(r) for r in finished_by)} had finished it" if finished_by else ""
    inside = here.get("item") == item.id and here.get("where") in ("inside", "waiting")
    phase = here.get("phase") or "setup"
    if here.get("item") == item.id:
        if inside:
            where, was = f"in {here.get('op')} #{here.get('index')} ({phase})", "was still"
        elif phase == "import":
            where, was = "while importing your module", "was still importing your module"
        else:
            where = f"while running your code in {phase} (not in a collective)"
            was = f"was still running your code in {phase} (not in a collective)"
    elif here.get("item"):
        where = f"before reaching this check (it was still in {here.get('item')})"
        was = f"never reached this check (it was still in {here.get('item')})"
    else:
        where, was = "before starting this check", "never started this check"
    if run is not None and run.timed_out:
        if was == "was still":
            was = f"was still {where}"
        return (f"rank {label}: {was} when the launch was stopped at its {run.seconds:.0f} s wall clock"
                f"{others}. A rank that skips or adds a collective, or loops forever, hangs the others.")
    order = run.order if run is not None else []
    first = order[0] if order else None
    if code is None:
        how = "was stopped"
    elif code in (-15, -9) and first is not None and first != job_rank and job_rank in order:
        who = f"rank {group.index(first)}" if first in group else "another rank"
        how = f"was stopped by the grader after {who}'s process ended"
    elif code == -9:
        how = "was killed by signal 9 (out of memory or over a resource limit?)"
    elif code == -6:
        how = "was aborted (signal 6)" + (": gloo aborts a process when the ranks pass tensors of different "
                                      "sizes to one collective" if inside else "")
    elif code == -11:
        how = "crashed (signal 11, a segmentation fault)"
    elif code < 0:
        how = f"was killed by signal {-code}"
    elif code == 0:
        how = "ended before writing its results (exit status 0: os._exit() in your code?)"
    else:
        how = f"ended with exit status {code}"
    tail = [ln for ln in (run.rank_output(job_rank) if run is not None else "").strip().splitlines()
            if not _C10D_NOISE.search(ln)][-6:]
    shown = ("\n    last output: " + "\n    ".join(tail)) if tail else ""
    return f"rank {label}: the process {how}, {where}{others}.{shown}"


def _desync(group: list[int], results: dict) -> str | None:
    """Name the first collective on which the ranks of an item's group disagree."""
    # point-to-point order differs between ranks by design (pipeline stages): compare collectives only; and per
    # sub-group where the switchboard's record names it (`members`): a 4-D layout's ranks run different collectives
    # on different groups (week 12)
    by_group: dict = {}
    for r, res in results.items():
        if res is not None:
            for e in res.ledger:
                if e.get("op") not in ("send", "recv"):
                    m = tuple(e["members"]) if isinstance(e.get("members"), list) else None
                    by_group.setdefault(m, {}).setdefault(group.index(r), []).append((e.get("phase"), e.get("op")))
    for m, found in by_group.items():
        seqs = {i: found.get(i, []) for i, r in enumerate(group) if results.get(r) is not None and (m is None or i in m)}
        if len({tuple(s) for s in seqs.values()}) <= 1:
            continue
        for i in range(max(len(s) for s in seqs.values())):
            calls = {r: (s[i] if i < len(s) else None) for r, s in seqs.items()}
            if len(set(calls.values())) > 1:
                desc = "; ".join(f"rank {r}: " + (f"{c[1]} ({c[0]})" if c else "nothing more")
                                 for r, c in calls.items())
                return (f"the ranks disagree on collective #{i + 1}: {desc}. Every rank must issue the same "
                        "collectives in the same order, or the job deadlocks.")
    return None


def run_checks(names: list[str], sources: dict[str, str], *, backend: str | None = None,
               launcher: str | None = None, fresh_seed: bool = True, sandbox: str | None = None,
               interactive: bool = False, graded_together: list[list[str]] | None = None,
               first: Attempt | None = None) -> Report:
    """Run the named checks on the student's module `sources` ({filename: text}) and compare here.

    All items run in one launch. When a rank process dies (abort, segfault, os._exit, out of memory) or
    the launch hits its wall clock, the item it died in is judged and the items after it run again in
    fresh ranks: one failure costs one check, never an unrelated, correct one.
    graded_together: groups of checks that score together (one grade cell). A relaunch skips the items of
    a group that has already failed: their points are lost whatever they do, and a submission that hangs
    at t = 2 would hang again at t = 3 and 4, each costing a deadlock's detection and a fresh launch.
    sandbox: "on" (bubblewrap, limits, an unprivileged uid; refused without bubblewrap), "auto" (the same,
    degraded where a lesser tool is missing) or "off"; default: GRADER_SANDBOX, else "auto".
    first: the job's first attempt, held since before this process imported torch
    (`grader.judge.attempt.hold_first_attempt(names, backend, sandbox, pg_timeout)`); used if the job agrees with it.
    """
    from launch import default_launcher, pick_backend
    t0 = time.monotonic()
    jobdir = first.jobdir if first is not None else tempfile.mkdtemp(prefix="grader-job-")
    runs, boxes = [], []
    try:
        items = plan_items(names)
        mode = sandbox or os.environ.get("GRADER_SANDBOX", "auto")
        backend = pick_backend(world_of(items), backend)
        launcher = default_launcher(backend, launcher, interactive=interactive and mode == "off")
        if first is not None and ((first.backend, first.launcher, first.mode) != (backend, launcher, mode)
                                  or interactive):
            first.cancel()
            first = None
        inputs = _prepare(jobdir, items, draw_seeds(items, fresh_seed), sources)
        refs = None
        together = graded_together or []
        verdicts: dict[str, ItemVerdict] = {}
        pending = items
        budget = job_wall_clock(len(items), PG_TIMEOUT, max(it.timeout for it in items))
        while pending:
            attempt = first if first is not None and not runs else Attempt(
                jobdir, len(runs), backend=backend, launcher=launcher, mode=mode, interactive=interactive)
            spec = JobSpec(items=pending, pg_timeout=PG_TIMEOUT, graded_together=together,
                           inputs=os.path.join(jobdir, "inputs", "rank{rank}.pt"),
                           student=os.path.join(jobdir, "student"))
            attempt.start(spec, timeout=job_wall_clock(len(pending), PG_TIMEOUT, max(it.timeout for it in pending)))
            if refs is None:        # the single-device references, computed while the first launch's ranks run
                try:
                    refs = _references(items, inputs)
                except BaseException:
                    attempt.cancel()
                    raise
            run, results = attempt.finish()
            runs.append(run)
            boxes.append(attempt.box)
            pending = _judge_launch(pending, run, results, refs, verdicts, together,
                                    out_of_time=time.monotonic() - t0 > budget)
        return Report(cases=_case_verdicts(items, verdicts), seconds=time.monotonic() - t0, runs=runs,
                      sandbox=boxes[-1].describe())
    finally:
        if first is not None and not runs:     # held, never run (the job failed before its first launch)
            first.cancel()
        shutil.rmtree(jobdir, ignore_errors=True)


def _prepare(jobdir: str, items: list[Item], seeds: dict[str, int], sources: dict[str, str]) -> dict:
    """The job folder's student modules and each rank's own inputs; returns the full inputs (kept here)."""
    os.makedirs(os.path.join(jobdir, "student"))
    for fname, text in sources.items():
        with open(os.path.join(jobdir, "student", os.path.basename(fname)), "w") as f:
            f.write(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = {it.id: get_case(it.case).make_inputs(it.config, torch.Generator().manual_seed(seeds[it.id]))
                  for it in items}
    os.makedirs(os.path.join(jobdir, "inputs"), mode=0o700)   # the grader's: see Attempt.own_inputs
    for j, own in enumerate(rank_views(items, inputs)):
        torch.save(own, os.path.join(jobdir, "inputs", f"rank{j}.pt"))
    return inputs


def _references(items: list[Item], inputs: dict) -> dict:
    """Each item's single-device reference, from the full inputs (independent of any student's sharding)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {it.id: get_case(it.case).reference(it.config, {k: v.clone() for k, v in inputs[it.id].items()})
                for it in items}


def _judge_launch(pending: list[Item], run, results: dict, refs: dict, verdicts: dict, together,
                  out_of_time: bool) -> list[Item]:
    """Judge what one launch lets us judge, skip what a failed check makes pointless; returns what runs again."""
    for it in _judgeable(pending, run, results):
        verdicts[it.id] = _judge(it, refs[it.id], results, run)
    left = [it for it in pending if it.id not in verdicts]
    failed_cases = {v.case for v in verdicts.values() if not v.passed}
    for it in [it for it in left if failed_with(it.case, failed_cases, together)]:
        verdicts[it.id] = _skipped(it, failed_with(it.case, failed_cases, together))
        left.remove(it)
    if left and out_of_time:
        for it in left:      # out of time: judge them with what this launch left
            verdicts[it.id] = _judge(it, refs[it.id], results, run)
        left = []
    return left


def _case_verdicts(items: list[Item], verdicts: dict[str, ItemVerdict]) -> dict[str, CaseVerdict]:
    cases: dict[str, CaseVerdict] = {it.case: CaseVerdict(it.case, True) for it in items}
    for it in items:
        cases[it.case].items.append(verdicts[it.id])
        cases[it.case].passed = cases[it.case].passed and verdicts[it.id].passed
    return cases


def _skipped(item: Item, failed: str) -> ItemVerdict:
    """An item not run because `failed`, a check scored with it, had failed (its points are lost either way)."""
    return ItemVerdict(item_id=item.id, case=item.case, t=item.t, passed=False, problems=[
        "not run: " + ("this check had already failed at a smaller size" if failed == item.case else
                        f"`{failed}`, scored together with this check, had already failed")
        + ": its points are lost either way, so the grader did not run it again."])


def _judgeable(items: list[Item], run, results: dict) -> list[Item]:
    """The items a launch lets us judge: all, unless a rank did not reach its end (died, was killed, left
    with os._exit, hung); then those complete and the one it stopped in. The rest run again, fresh."""
    world = results["world"]
    if not any(results["progress"].values()) and not run.ok:
        # no rank ever reached the harness: a broken installation or sandbox, not the student's code
        raise GraderCannotRun(f"the grader could not start its ranks ({run.root_cause()[-1500:]})")
    complete = [_complete(it, results) for it in items]
    ended_early = run.timed_out or any(results["progress"][r].get("phase") != "done" for r in range(world))
    if not ended_early or all(complete):
        return items
    done = [it for it, ok in zip(items, complete) if ok]
    if done and DEADLOCKED in run.exitcodes.values():
        # a rank left a deadlocked check with its verdict written: the job stopped for that one, the next never
        # started. An exit status is the student's to forge, so this never holds a launch that judged nothing:
        # every launch judges at least one item, and a job always ends
        return done
    return done + [items[complete.index(False)]]


def _result(results: dict, r: int, it: Item) -> RankRecord | None:
    return results["ranks"].get(r, {}).get(it.id)


def _complete(it: Item, results: dict) -> bool:
    return all(_result(results, r, it) is not None for r in participants(it.t, results["world"]))


def _judge(it: Item, ref: dict, results: dict, run) -> ItemVerdict:
    case = get_case(it.case)
    part = participants(it.t, results["world"])
    res = {r: _result(results, r, it) for r in part}
    skipped = sorted({x.skipped for x in res.values() if x is not None and x.skipped})
    if skipped and all(x is not None and x.skipped for x in res.values()):
        return _skipped(it, skipped[0])
    finished = [r for r in part if res[r] is not None and not res[r].error]
    reasons = {r: results["untrusted"].get(r) or _missing_reason(r, it, run, results["progress"], finished, part)
               for r in part if res[r] is None}
    v = compare_item(case, it, ref, part, res, reasons)
    own_errors = any(x is not None and x.error and not is_comm_error(x.error) for x in res.values())
    d = None if own_errors else _desync(part, res)   # a rank's own exception explains the rest
    if d and not v.passed:
        v.problems.insert(0, d)
    return v
