"""What a rank measures with should be what the course wrote: a seal over the harness's code objects.

The ledger, the gathered-weight watch, the deadlock watch, the rank context and torch.distributed's
functions all run in the student's process, so a student's module could replace them at import time
(e.g. a monitor that always reports the allowed peak). `Seal` records the identity of every function and
class attribute of those modules before any student code is imported; `broken()` names what was
replaced since. Nothing measured in a rank carries points (grader/judge/compare.py: only values and the
switchboard's record do), so a broken seal is a note beside the verdict: the rank-side feedback of that
check (overlap order, peaks, what was saved) cannot be believed.
"""
from __future__ import annotations

import importlib
import sys
import warnings

import torch

# the harness's measuring code and what it stands on; the light ones are imported to be sealed, the
# others (DTensor's helpers) are sealed when the week's run functions imported them
MEASURING = ("tpkit.dispatch", "tpkit.ledger", "tpkit.progress", "tpkit.gather_watch", "tpkit.timeline", "tpkit.pipeline")
SEALED = MEASURING + ("tpkit.dtensor", "grader.rank.context", "grader.rank.watch",
                      "torch.distributed.distributed_c10d", "torch.utils._python_dispatch")


class Tampered(Exception):
    """The harness's code was replaced: its message becomes a note."""


def _callables(prefix: str, namespace: dict) -> dict[str, int]:
    with warnings.catch_warnings():      # looking at a deprecated name (dist.reduce_op) must not warn
        warnings.simplefilter("ignore")
        return _ids(prefix, namespace)


def _ids(prefix: str, namespace: dict) -> dict[str, int]:
    out = {}
    for name, obj in list(namespace.items()):
        if callable(obj) and not isinstance(obj, type):
            out[f"{prefix}.{name}"] = id(obj)
        elif isinstance(obj, type) and getattr(obj, "__module__", "") == prefix:
            for attr, val in list(vars(obj).items()):
                if callable(val) or isinstance(val, (staticmethod, classmethod, property)):
                    out[f"{prefix}.{name}.{attr}"] = id(val)
    return out


class Seal:
    def __init__(self):
        for mod in MEASURING:
            importlib.import_module(mod)
        # the week's run functions and the entry measure too (e.g. week 6's order of posts, GEMMs and waits)
        self.modules = SEALED + tuple(sorted(m for m in sys.modules if m.startswith("grader.rank.")))
        self.ids: dict[str, int] = {}
        for mod in self.modules:
            if mod in sys.modules:
                self.ids.update(_callables(mod, vars(sys.modules[mod])))
        work = torch._C._distributed_c10d.Work
        self.ids["Work.wait"] = id(work.wait)
        self.ids["torch.Tensor.__torch_dispatch__"] = id(torch.Tensor.__dict__.get("__torch_dispatch__"))

    def broken(self) -> list[str]:
        now = {}
        for mod in self.modules:
            if mod in sys.modules:
                now.update(_callables(mod, vars(sys.modules[mod])))
        now["Work.wait"] = id(torch._C._distributed_c10d.Work.wait)
        now["torch.Tensor.__torch_dispatch__"] = id(torch.Tensor.__dict__.get("__torch_dispatch__"))
        return sorted(k for k, v in self.ids.items() if now.get(k) != v)

    def check(self):
        changed = self.broken()
        if changed:
            raise Tampered(f"your code replaced {', '.join(changed[:3])}"
                           + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                           + ": the feedback measured inside your process (order, peaks, what was saved) "
                           "cannot be believed for this check.")
