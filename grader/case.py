"""A check is declarative: a `Case` says what to build, what each rank runs, what it must match.

Everything that decides a grade lives here, in the grader package, never in an
assignment folder (nbgrader copies those to students and back).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Contract:
    """What a correct tensor-parallel implementation communicates and holds, per rank.

    counts: phase -> {op: exact count}; an op not listed must not occur in that phase.
    allowed_ops: if set, no other op may occur in any phase (e.g. only send/recv).
    bytes_sent: phase (or "all") -> bytes one rank must send, within 1%.
    params: name -> shape each rank's module must hold (its shard, not the dense weight).
    """
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    allowed_ops: set[str] | None = None
    bytes_sent: dict[str, float] = field(default_factory=dict)
    params: dict[str, tuple] | None = None
    why: dict[str, str] = field(default_factory=dict)  # phase -> the reason the count is what it is


class GradingError(Exception):
    """Raised by the harness on a rank when the student's result cannot even be used (e.g. an
    output of the wrong shape cannot be backpropagated); its message is the whole verdict."""


@dataclass
class RankContext:
    rank: int                 # rank inside the case's group
    world_size: int           # the case's tensor-parallel size t
    group: Any                # process group to hand the student (None = the default group)
    device: torch.device
    ledger: Any
    params: dict = field(default_factory=dict)

    def phase(self, name: str):
        self.ledger.set_phase(name)

    def record_params(self, module: torch.nn.Module, prefix: str = ""):
        for n, p in module.named_parameters():
            self.params[prefix + n] = list(p.shape)

    @staticmethod
    def backward(y, dy, name: str = "y"):
        """y.backward(dy), after checking that the student's output can take dy at all."""
        if not isinstance(y, torch.Tensor):
            raise GradingError(f"`{name}` is a {type(y).__name__}, not a tensor: forward must return a tensor.")
        if tuple(y.shape) != tuple(dy.shape):
            raise GradingError(f"`{name}` has shape {tuple(y.shape)}; expected {tuple(dy.shape)} "
                               "(so backward could not run).")
        if not y.requires_grad:
            raise GradingError(f"`{name}` does not require grad: the autograd graph was cut "
                               "(.detach(), torch.no_grad() or .data in forward?).")
        y.backward(dy)

    @staticmethod
    def grad(module, name: str = "weight"):
        """module.<name>.grad, or None when the student's module has no such parameter (the
        contract's parameter check then says so, instead of the harness crashing)."""
        p = getattr(module, name, None)
        return getattr(p, "grad", None) if isinstance(p, torch.Tensor) else None

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.world_size, dim=dim)[self.rank].contiguous()


@dataclass
class Case:
    name: str                                   # "week02/column_parallel"
    module: str                                 # the student's module, e.g. "tp_linear"
    world_sizes: tuple[int, ...]
    config: dict
    make_inputs: Callable[[dict, torch.Generator], dict]          # trusted process: full tensors
    reference: Callable[[dict, dict], dict]                       # trusted process: dense results
    run_rank: Callable[[Any, dict, dict, RankContext], dict]      # on each rank, beside student code
    expected: Callable[[dict, dict, int, int], dict]              # (cfg, ref, rank, t) -> that rank's tensors
    contract: Callable[[dict, int], Contract] | None = None
    atol: float = 1e-3
    seed: int | None = 0                        # None: drawn fresh at grading time (hidden cases)
    hidden: bool = False
    title: str = ""
    hints: dict[str, str] = field(default_factory=dict)          # tensor name -> what a mismatch usually means
    timeout: int | None = None                  # seconds one rank may spend in this case (default ITEM_TIMEOUT)


_REGISTRY: dict[str, Case] = {}
WEEKS = ("week02",)


def register(case: Case) -> Case:
    if case.name in _REGISTRY:
        raise ValueError(f"case {case.name!r} is registered twice")
    _REGISTRY[case.name] = case
    return case


def get_case(name: str) -> Case:
    week = name.split("/")[0]
    try:
        importlib.import_module(f"grader.cases.{week}")
    except ModuleNotFoundError:
        pass
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"no check named {name!r}. Known checks: {known}")
    return _REGISTRY[name]


def all_cases() -> dict[str, Case]:
    import pkgutil
    import grader.cases
    for m in pkgutil.iter_modules(grader.cases.__path__):
        importlib.import_module(f"grader.cases.{m.name}")
    return dict(_REGISTRY)
