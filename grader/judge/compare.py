"""Trusted comparison: rank results vs the single-device reference, and the contract.

Runs in the grader's own process. Rank files are read with weights_only=True, so a
result file cannot run code here; every value is checked for type before use.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch

from grader.judge.case import Case, Contract
from grader.rank.exchange import SWITCHBOARD_VERDICT, Item, RankRecord
from launch.isolation import refusal_in
from tpkit.course_imports import NOT_AT_GRADING


@dataclass
class ItemVerdict:
    item_id: str
    case: str
    t: int
    passed: bool
    problems: list[str] = field(default_factory=list)
    max_err: float = 0.0
    comm: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)   # seen inside the student's process: said, never scored


def _fmt_shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ")"


def _where(idx: int, shape) -> str:
    coords = []
    for d in reversed(list(shape)):
        coords.append(idx % d)
        idx //= d
    return "[" + ", ".join(str(c) for c in reversed(coords)) + "]"


# what NaN most often means when each rank is handed only its own part of a dense tensor (Case.rank_inputs)
NOT_YOURS = ("Each rank is handed only what it owns: the other ranks' parts of a dense tensor it receives "
             "are NaN, so NaN here usually means your code read rows or columns that belong to another rank.")


def compare_tensor(name: str, got, want: torch.Tensor, atol: float, rank: int, hint: str = "",
                   nan_hint: str = "") -> tuple[str | None, float]:
    """None if `got` matches `want` at atol, else a message a student can act on."""
    who = f"rank {rank}: `{name}`"
    tail = f" {hint}" if hint else ""
    if got is None:
        return f"{who} is missing (None).{tail}", math.inf
    if not isinstance(got, torch.Tensor):
        return f"{who} is a {type(got).__name__}, not a tensor.", math.inf
    if tuple(got.shape) != tuple(want.shape):
        return f"{who} has shape {_fmt_shape(got.shape)}; expected {_fmt_shape(want.shape)}.{tail}", math.inf
    if got.dtype != want.dtype:
        return f"{who} is {str(got.dtype).replace('torch.', '')}; expected {str(want.dtype).replace('torch.', '')}.", math.inf
    if not got.is_floating_point():
        bad = (got != want)
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            return (f"{who} differs at {_where(i, got.shape)}: got {got.flatten()[i].item()}, "
                    f"expected {want.flatten()[i].item()}.{tail}"), math.inf
        return None, 0.0
    finite = torch.isfinite(got)
    if not finite.all():
        n_nan, n_inf = int(torch.isnan(got).sum()), int(torch.isinf(got).sum())
        i = int((~finite).flatten().nonzero()[0])
        kinds = " and ".join(k for k, n in (("NaN", n_nan), ("Inf", n_inf)) if n)
        extra = f" {nan_hint}" if nan_hint and n_nan else ""
        return (f"{who} contains {kinds} ({n_nan + n_inf} of {got.numel()} values, first at {_where(i, got.shape)})."
                f"{extra}{tail}", math.inf)
    err = (got.double() - want.double()).abs()
    m = float(err.max()) if err.numel() else 0.0
    if m <= atol:
        return None, m
    i = int(err.flatten().argmax())
    passing = 10 ** math.ceil(math.log10(m)) if m > 0 else atol
    return (f"{who} differs from the single-device reference: max |err| {m:.3g} at {_where(i, got.shape)} "
            f"(got {got.flatten()[i].item():.5g}, expected {want.flatten()[i].item():.5g}); atol is {atol:g} "
            f"(it would take atol={passing:g} to pass).{tail}", m)


def _phase_order(entries: list, rank: int) -> list[str]:
    """A rank names the phase of each collective itself, so the order is checked: "setup" before anything else,
    nothing but the grader's own ("harness") after it. A collective relabelled as either, mid-check, is named."""
    seen_other = seen_harness = False
    for e in entries:
        phase = e.get("phase")
        if phase == "setup" and seen_other:
            return [f"rank {rank}: a collective labelled setup came after the check's own: setup comes first."]
        if phase != "harness" and seen_harness:
            return [f"rank {rank}: a collective labelled {phase} came after the grader's own (harness), which come "
                    "last: only the grader labels collectives harness."]
        seen_other = seen_other or phase != "setup"
        seen_harness = seen_harness or phase == "harness"
    return []


def check_contract(contract: Contract, res: RankRecord, rank: int) -> list[str]:
    entries = res.ledger
    problems = _phase_order(entries, rank)
    ops_by_phase: dict[str, dict[str, int]] = {}
    for e in entries:
        ops_by_phase.setdefault(str(e.get("phase")), {}).setdefault(str(e.get("op")), 0)
        ops_by_phase[str(e.get("phase"))][str(e.get("op"))] += 1
    for phase, got in ops_by_phase.items():
        # every collective counts, barriers included: a phase the contract does not name may have none
        if contract.counts and phase not in contract.counts and phase not in contract.unchecked:
            for op, n in sorted(got.items()):
                problems.append(f"rank {rank}: {phase} used {n} {op}; the contract allows no collective there.")
    for phase, want in contract.counts.items():
        got = ops_by_phase.get(phase, {})
        for op in sorted(set(want) | set(got)):
            w, g = want.get(op, 0), got.get(op, 0)
            if w != g:
                why = contract.why.get(phase, "")
                problems.append(f"rank {rank}: {phase} used {g} {op}; the contract is {w}." + (f" {why}" if why else ""))
    if contract.allowed_ops is not None:
        extra = sorted({str(e.get("op")) for e in entries} - contract.allowed_ops)
        if extra:
            problems.append(f"rank {rank}: used {', '.join(extra)}; only {', '.join(sorted(contract.allowed_ops))} "
                            f"are allowed here.")
    for phase, want in contract.bytes_sent.items():
        got = sum(e["sent"] for e in entries if isinstance(e.get("sent"), (int, float)) and (phase == "all" or e.get("phase") == phase))
        if abs(got - want) > 0.01 * max(want, 1.0):
            why = contract.why.get(phase, "")
            problems.append(f"rank {rank}: sent {got:.0f} bytes ({phase}); the ring optimum is {want:.0f}."
                            + (f" {why}" if why else ""))
    return problems


def check_params(contract: Contract, res: RankRecord, rank: int) -> list[str]:
    """The shapes the rank says its module holds against its shards: notes (the rank's word about itself)."""
    problems = []
    if contract.params is not None:
        got = {k: tuple(v) for k, v in res.params.items()}
        for name, shape in contract.params.items():
            if name not in got:
                problems.append(f"rank {rank}: no parameter named `{name}` (found: {', '.join(got) or 'none'}); "
                                f"keep the shard in `self.{name}` as an nn.Parameter.")
            elif tuple(got[name]) != tuple(shape):
                problems.append(f"rank {rank}: keeps `{name}` of shape {_fmt_shape(got[name])}; its shard is "
                                f"{_fmt_shape(shape)}: each rank must keep only 1/t of the dense weight.")
    return problems


_COMM_ERRORS = ("Connection closed by peer", "Application timeout", "Timed out", "timed out", "pair closure",
                "NCCL", "ProcessGroupGloo", "Connection reset", "Broken pipe")


def is_comm_error(tb: str) -> bool:
    """Did a collective fail under this rank (a peer died or never came), rather than its own code?"""
    last = tb.rstrip().splitlines()[-1] if tb.strip() else ""
    if last.startswith(SWITCHBOARD_VERDICT):   # waited in a deadlock, or its group disagreed on a collective
        return True
    return last.startswith(("RuntimeError", "DistBackendError", "DistNetworkError", "torch.distributed")) and \
        any(k in last for k in _COMM_ERRORS)


def last_collective(res: RankRecord | None) -> str:
    n = len(res.ledger) if res is not None else 0
    return f"collective #{n + 1} (after {n} that completed)" if n else "its first collective"


# an import of a course package that grading ranks cannot see
_COURSE_IMPORT = re.compile(rf"^\s*(?:from|import)\s+((?:{'|'.join(NOT_AT_GRADING)})(?:\.\w+)*)", re.M)


def describe_error(tb: str, rank, res: RankRecord | None = None) -> str:
    """A student's exception, short: a stub says what to write, anything else keeps its traceback."""
    lines = tb.rstrip().splitlines()
    last = lines[-1] if lines else "an exception"
    if last.startswith("NotImplementedError"):
        where = ""
        for ln in lines:
            m = re.match(r'\s*File "(.+?)", line (\d+), in (\S+)', ln)
            if m:
                where = f"`{m.group(3)}` ({os.path.basename(m.group(1))} line {m.group(2)})"
        return f"rank {rank}: not implemented yet: {where} raises {last}"
    course = _COURSE_IMPORT.findall(tb) if last.startswith(("ModuleNotFoundError", "ImportError")) else []
    if course:
        return (f"rank {rank}: your module imports `{course[-1]}`, the course's own code, which is not there when "
                "grading: only torch, the standard library and the teaching library `tpkit` are. Write it yourself.")
    if last.startswith("SystemExit"):
        return (f"rank {rank}: your code called sys.exit() ({last}); a layer must return its result, "
                "never end the process.")
    if last.startswith(SWITCHBOARD_VERDICT):        # judged outside the ranks: a deadlock, a mismatch
        return last[len(SWITCHBOARD_VERDICT):]
    if last.startswith("grader.rank.watch.Deadlock:"):
        return last.split(":", 1)[1].strip()        # the same picture on every waiting rank: said once
    if last.startswith(("GradingError:", "grader.rank.context.GradingError:")):
        return f"rank {rank}: " + last.split(":", 1)[1].strip()
    refused = refusal_in(tb)
    if refused:                                     # a call the grading box refuses (launch.isolation.REFUSED)
        what, why = refused
        return f"rank {rank}: the grading box refused {what}: {why}.\n{tb.rstrip()}"
    if is_comm_error(tb):
        where = last_collective(res)
        kind = "timed out" if "timeout" in last.lower() or "timed out" in last.lower() else "lost its peers"
        return (f"rank {rank}: {kind} in {where}: {last[:200]}. A peer never joined this collective: "
                "a rank skipped or added a collective, or crashed.")
    return f"rank {rank}: raised an exception:\n{tb.rstrip()}"


_SHORT = {"forward": "fwd", "backward": "bwd"}


def comm_summary(res: RankRecord) -> str:
    """The collectives of a rank per phase: forward and backward (named even when empty) where a case has them,
    else whatever phases its harness names (week 12: the first layout, the checkpoint, the resumed layout)."""
    by_phase: dict[str, dict[str, int]] = {}
    for e in res.ledger:
        ops = by_phase.setdefault(str(e.get("phase")), {})
        ops[str(e.get("op"))] = ops.get(str(e.get("op")), 0) + 1
    phases = ("forward", "backward") if by_phase.keys() & {"forward", "backward"} or not by_phase else by_phase
    return "; ".join(f"{_SHORT.get(p, p)}: " + (", ".join(f"{op} x{n}" for op, n in by_phase[p].items())
                                               if p in by_phase else "none") for p in phases)


def rank_list(ranks) -> str:
    """'rank 2', 'ranks 2 and 3', 'ranks 0, 1 and 3'."""
    rs = [str(r) for r in sorted(set(int(r) for r in ranks))]
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return f"ranks {', '.join(rs[:-1])} and {rs[-1]}"


def compare_item(case: Case, item: Item, ref: dict, group: list[int], results: dict[int, RankRecord | None],
                 missing_reason: dict[int, str]) -> ItemVerdict:
    """Every problem of one case at one t, the likely root cause first: what a rank communicated or
    holds, then its own exception, a deadlock, ranks without results, peers that only saw the fallout,
    and last the tensors, in data-flow order (outputs before input grads before weight grads).
    `group`: the job ranks that ran the item, in group-rank order (exchange.participants), which decides the
    shard each rank's result is compared with; never what a rank says of itself."""
    t = item.t
    v = ItemVerdict(item_id=item.id, case=case.name, t=t, passed=True)
    contract = case.contract(item.config, t) if case.contract else None
    errors = {j: res.error for j, res in results.items() if res is not None and res.error}
    own = {j for j, e in errors.items() if not is_comm_error(e)}   # the student's own exceptions
    comm, raised, deadlock, missing, fallout, tensors, notes = [], [], [], [], [], {}, []
    for job_rank in sorted(results):
        res = results[job_rank]
        if res is None:
            missing.append(missing_reason.get(job_rank, f"rank {job_rank} wrote no result."))
            continue
        r = group.index(job_rank)
        if job_rank in errors:
            # a rank whose collective broke because a peer raised or died only saw the fallout
            culprits = sorted(own | {j for j, x in results.items() if x is None})
            if job_rank in own or not culprits:
                msg = describe_error(errors[job_rank], r, res)
                # the same picture on every rank of the group: said once
                judged = msg.startswith("deadlock:") or errors[job_rank].startswith(SWITCHBOARD_VERDICT)
                (deadlock if judged else raised).append(msg)
            else:
                fallout.append(f"rank {r}: left waiting in {last_collective(res)} because "
                               f"{rank_list(group.index(j) for j in culprits)} failed.")
            continue
        if contract is not None:   # sharding and communication first: they explain the numbers
            comm += check_contract(contract, res, r)
            notes += check_params(contract, res, r)
        notes += [f"rank {r}: {n}" for n in res.notes]
        want = case.expected(item.config, ref, r, t)
        got = res.tensors
        if case.evaluate is not None:      # plain data the rank returned, evaluated here
            try:
                got = case.evaluate(item.config, got)
            except (ValueError, TypeError, KeyError) as exc:
                tensors.setdefault("", []).append(f"rank {r}: what it returned could not be evaluated ({exc}).")
                continue
        if case.from_record is not None:
            got = {**got, **case.from_record(item.config, res.ledger, r, t)}
        for name, w in want.items():
            msg, m = compare_tensor(name, got.get(name), w, case.atol, r, case.hints.get(name, ""),
                                    NOT_YOURS if case.rank_inputs else "")
            if msg and name in case.feedback:
                notes.append(msg)
            elif msg:
                tensors.setdefault(name, []).append(msg)
            elif m > v.max_err:
                v.max_err = m
        v.comm = comm_summary(res)
        v.seconds = max(v.seconds, float(res.seconds))
    # every waiting rank names the deadlock as it saw it: the first picture is the whole story
    if deadlock:     # a peer that lost its connection when a deadlocked rank left is part of the same story
        fallout = []
    v.problems = comm + raised + deadlock[:1] + missing + fallout + [m for ms in tensors.values() for m in ms]
    v.passed = not v.problems
    v.notes = notes
    return v
