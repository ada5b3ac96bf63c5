"""What the rank entry hands a week's run function besides the student's module: its group, ledger, helpers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class GradingError(Exception):
    """Raised on a rank when the student's result cannot even be used (e.g. an output of the wrong
    shape cannot be backpropagated); its message is the whole verdict."""


@dataclass
class RankContext:
    rank: int                 # rank inside the case's group
    world_size: int           # the case's tensor-parallel size t
    group: Any                # process group to hand the student (None = the default group)
    device: torch.device
    ledger: Any
    params: dict = field(default_factory=dict)
    handed: list = field(default_factory=list)   # (name, tensor, copy): what the student's code was given
    notes: list = field(default_factory=list)    # rules seen broken inside the rank: feedback, never points

    def hand(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Give `t` to the student's code; `check_handed` later proves it came back unchanged."""
        self.handed.append((name, t, t.detach().clone()))
        return t

    def hand_module(self, name: str, module: torch.nn.Module) -> torch.nn.Module:
        """Give a dense module to the student's code (e.g. `from_dense`): it may read it, never write into it."""
        for n, p in module.named_parameters():
            self.hand(f"{name}.{n}", p)
        return module

    def note(self, message: str):
        """A rule seen broken inside this rank (the student's process): said in the verdict, never scored."""
        if message not in self.notes:
            self.notes.append(message)

    def check_handed(self):
        """A function should not write into the tensors it is given (its caller still needs them). Seen from
        inside the rank, so a note: a write that changed a value the check uses shows in the compared values."""
        for name, t, copy in self.handed:
            # exact, NaN == NaN: a handed tensor carries NaN where another rank's part would be
            if t.shape != copy.shape or not torch.allclose(t.detach(), copy, rtol=0, atol=0, equal_nan=True):
                self.note(f"your code overwrote its input `{name}` in place: a function should not write into the "
                          "tensors it is given (its caller still uses them); receive into buffers of your own.")

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
