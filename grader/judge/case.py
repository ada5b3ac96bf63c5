"""A check is declarative: a `Case` says what to build, what each rank runs, what it must match.

Everything that decides a grade lives here and in `grader/cases/`, never in an assignment
folder (nbgrader copies those to students and back). A case runs in the trusted process; what
each rank runs is named by `run_rank` and lives in `grader/rank/<week>.py`, the only part of the
grader a grading rank can see.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Contract:
    """What a correct tensor-parallel implementation communicates and holds, per rank.

    counts: phase -> {op: exact count}; an op not listed must not occur in that phase, and a phase not
        listed (e.g. "setup": from_dense, __init__) must have no collective at all, barriers included.
    unchecked: phases whose collectives are not counted ("harness" in week 7, where the grader's reading of
        Partial grads communicates as the student's plan decides). A rank names its phase itself: the order of
        phases is checked (compare._phase_order), and where the grader's own collectives are known they are
        counted instead (week 6's plain version: counts["harness"]).
    allowed_ops: if set, no other op may occur in any phase (e.g. only send/recv).
    bytes_sent: phase (or "all") -> bytes one rank must send, within 1%.
    params: name -> shape each rank's module holds (its shard, not the dense weight), as the rank reports it:
        a note, never scored (a rank holding more than its shard is caught by its values: it receives only its
        own part of every dense tensor, the rest NaN).
    """
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    allowed_ops: set[str] | None = None
    bytes_sent: dict[str, float] = field(default_factory=dict)
    params: dict[str, tuple] | None = None
    why: dict[str, str] = field(default_factory=dict)  # phase -> the reason the count is what it is
    unchecked: tuple[str, ...] = ()


@dataclass
class Case:
    name: str                                   # "week02/column_parallel"
    module: str                                 # the student's module, e.g. "tp_linear"
    world_sizes: tuple[int, ...]
    config: dict
    make_inputs: Callable[[dict, torch.Generator], dict]          # trusted process: full tensors
    reference: Callable[[dict, dict], dict]                       # trusted process: dense results
    run_rank: str                               # function in grader/rank/<week>.py: (module, cfg, inputs, ctx) -> tensors
    expected: Callable[[dict, dict, int, int], dict]              # (cfg, ref, rank, t) -> that rank's tensors
    contract: Callable[[dict, int], Contract] | None = None
    atol: float = 1e-3
    seed: int | None = 0    # for reproducible runs only (tests): grading draws every case's seed fresh (job.draw_seeds)
    hidden: bool = False
    title: str = ""
    hints: dict[str, str] = field(default_factory=dict)          # tensor name -> what a mismatch usually means
    timeout: int | None = None                  # seconds one rank may spend in this case (default ITEM_TIMEOUT)
    # (cfg, inputs, r, t) -> what rank r of t receives: only what a real rank owns (its shards, the replicated
    # tensors); a dense tensor an API hands over has the other ranks' parts poisoned (NaN). The full inputs and
    # the expected values stay in the trusted process. None: every rank receives the full inputs.
    rank_inputs: Callable[[dict, dict, int, int], dict] | None = None
    # (cfg, what one rank returned) -> the tensors compared with `expected`, computed here in the trusted process:
    # a task whose answer is plain data (a schedule) is returned as data and evaluated (simulated) where the
    # student's code cannot reach the evaluator. Raises ValueError on data of the wrong type.
    evaluate: Callable[[dict, dict], dict] | None = None
    # (cfg, the record of this rank's collectives in this item, its place r, t) -> tensors compared with `expected`,
    # computed here:
    # what a rank communicated (all-reduce ops, split sizes, bytes) is read from the record the launcher's
    # switchboard kept outside the rank (grader/judge/attempt.py), never from what the rank says of itself
    from_record: Callable[[dict, list, int, int], dict] | None = None
    # names of result tensors the rank measures inside the student's process (an order of posts and GEMMs, a peak
    # of live objects, what autograd saved): the student's code can rewrite them, so they are compared and a
    # mismatch is said as a note, never scored. Points rest on values and the switchboard's record only.
    feedback: tuple[str, ...] = ()


def shard(t: torch.Tensor, r: int, n: int, dim: int) -> torch.Tensor:
    """Rank r's block of n along `dim` (torch.chunk's split: what every lab calls rank r's shard)."""
    return t.chunk(n, dim=dim)[r].contiguous()


def poisoned(t: torch.Tensor, r: int, n: int, dim: int) -> torch.Tensor:
    """`t` with every block but rank r's (of n along `dim`) set to NaN: a dense tensor an API hands a rank
    (e.g. `from_dense(linear)`) carries only what that rank owns, and code that reads another rank's part
    gets NaN instead of an answer it could not have computed without communicating."""
    out = torch.full_like(t, float("nan"))
    out.narrow(dim, sum(c.shape[dim] for c in t.chunk(n, dim=dim)[:r]), shard(t, r, n, dim).shape[dim]).copy_(
        shard(t, r, n, dim))
    return out


_REGISTRY: dict[str, Case] = {}


def register(case: Case) -> Case:
    if case.name in _REGISTRY:
        raise ValueError(f"case {case.name!r} is registered twice")
    _REGISTRY[case.name] = case
    return case


def cases_of_week(week: str) -> list[Case]:
    """Every case `week` registers, in its order."""
    importlib.import_module(f"grader.cases.{week}")
    return [case for name, case in _REGISTRY.items() if name.split("/")[0] == week]


def get_case(name: str) -> Case:
    week = name.split("/")[0]
    if importlib.util.find_spec(f"grader.cases.{week}") is not None:
        importlib.import_module(f"grader.cases.{week}")   # a broken case module raises here, not "no check"
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"no check named {name!r}. Known checks: {known}")
    return _REGISTRY[name]
