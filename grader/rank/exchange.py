"""The contract between the trusted process and the ranks of a grading job, in one place both sides import.

The trusted side (grader/judge/job.py, grader/judge/attempt.py) writes a `JobSpec` to JOBDIR/attemptK/spec.json and each
job rank's own inputs; every rank (grader/rank/entry.py) reads the spec, runs the items in order and writes a
`RankRecord` per item to out/rank{r}.pt; the trusted side reads those back through `RankRecord.from_saved`,
which checks every field's type (a rank's process is the student's: what it wrote is data, never trusted).
The rules both sides apply (how a job's ranks form groups, which checks are skipped after a failure) are the
functions here. The tensor-parallel size of an item is `t` everywhere, from the grade cell to the rank.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

SWITCHBOARD_VERDICT = "switchboard: "   # a record's error judged by the launcher's switchboard, not by the rank
DEADLOCKED = 3     # exit status of a rank that left a deadlocked check (its verdict is in its record)
DTENSOR_TABLE = "COURSE_DTENSOR_TABLE"   # the launcher's DTensor sharding tables (grader/rank/dtensor_table.py)


@dataclass(frozen=True)
class Item:
    """One case at one tensor-parallel size t: what every rank of the job runs, in spec order. No seed: the
    inputs' seed stays in the trusted process (a rank holding it could rebuild every other rank's data)."""
    id: str                 # "week02/mlp@t2"
    case: str               # "week02/mlp"
    module: str             # the student's module the case imports
    run_rank: str           # the function in grader/rank/<week>.py
    t: int
    config: dict
    timeout: int            # seconds one rank may spend in this item (SIGALRM)

    @property
    def week(self) -> str:
        return self.case.split("/")[0]


@dataclass
class JobSpec:
    items: list[Item]
    pg_timeout: float
    inputs: str             # path of each rank's own inputs, with {rank}
    student: str            # the folder of the student's modules
    graded_together: list[list[str]] = field(default_factory=list)

    def save(self, path: str):
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str) -> "JobSpec":
        with open(path) as f:
            d = json.load(f)
        return cls(**{**d, "items": [Item(**it) for it in d["items"]]})


def world_of(items: list[Item]) -> int:
    """A launch runs every item on max(t) ranks; a smaller size on a group of them (participants)."""
    return max(it.t for it in items)


def participants(t: int, world: int) -> list[int]:
    """The job ranks that run an item of size t, as one group: the job's last t ranks; the others sit it out.
    One group, not world // t copies of it: a second group would compute the same item again, for no more
    evidence. The last ranks, not the first: a rank's place in the group then differs from its job rank
    whenever t < world, so code that uses dist.get_rank() or the default group where it must use the group
    it is given fails at every smaller size."""
    return list(range(world - t, world))


def failed_with(case: str, failed_cases: set[str], graded_together: list[list[str]]) -> str | None:
    """A check scored with `case` (the same grade cell, or `case` itself) that has failed: its points are lost,
    so `case` is not run again (a hang would cost a timeout again)."""
    group = next((g for g in graded_together if case in g), [case])
    return next((c for c in group if c in failed_cases), None)


_SCALAR = (str, int, float, bool, type(None))


@dataclass
class RankRecord:
    """What one rank reports for one item. Which group it ran in is not its to say: the trusted side knows
    (participants). Only `tensors` (values the rank could compute only by doing the task) and `error` can cost
    points; `params` and `notes` are the rank's word about itself, shown as feedback."""
    tensors: dict = field(default_factory=dict)     # name -> tensor or None, for the trusted compare
    params: dict = field(default_factory=dict)      # parameter name -> shape this rank's module holds
    ledger: list = field(default_factory=list)      # the in-process record of collectives (teaching evidence)
    error: str = ""                        # a traceback, or the harness's own verdict
    seconds: float = 0.0
    skipped: str = ""                      # a failed check scored with this one: not run
    notes: list = field(default_factory=list)   # what the harness saw inside the rank: feedback, never points

    def to_saved(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_saved(cls, rec) -> "RankRecord":
        """Check the type of every field a rank wrote; ValueError names the first that is wrong."""
        import torch
        if not isinstance(rec, dict):
            raise ValueError(f"a {type(rec).__name__}, not a record")
        kinds = {"tensors": dict, "params": dict, "ledger": list, "error": str, "skipped": str,
                 "seconds": (int, float), "notes": list}
        for key, val in rec.items():
            if key not in kinds:
                raise ValueError(f"an unknown field `{key}`")
            if not isinstance(val, kinds[key]) or isinstance(val, bool):
                raise ValueError(f"`{key}` is a {type(val).__name__}")
        if not all(isinstance(k, str) and (v is None or isinstance(v, torch.Tensor))
                   for k, v in rec.get("tensors", {}).items()):
            raise ValueError("`tensors` holds something other than tensors")
        if not all(isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(d, int) for d in v)
                   for k, v in rec.get("params", {}).items()):
            raise ValueError("`params` holds something other than shapes")
        if not all(isinstance(e, dict) and all(isinstance(k, str) and (isinstance(v, _SCALAR) or (
                isinstance(v, list) and all(isinstance(x, _SCALAR) for x in v))) for k, v in e.items())
                   for e in rec.get("ledger", [])):
            raise ValueError("`ledger` holds something other than plain records")
        if not all(isinstance(n, str) for n in rec.get("notes", [])):
            raise ValueError("`notes` holds something other than strings")
        return cls(**rec)


def records_from_saved(saved) -> dict[str, RankRecord]:
    """A rank's file ({item id: record}) as typed records; ValueError on anything else."""
    if not isinstance(saved, dict):
        raise ValueError(f"a {type(saved).__name__}, not a dict of items")
    out = {}
    for item_id, rec in saved.items():
        if not isinstance(item_id, str):
            raise ValueError("an item id that is not a string")
        try:
            out[item_id] = RankRecord.from_saved(rec)
        except ValueError as exc:
            raise ValueError(f"item {item_id[:40]!r}: {exc}") from None
    return out
