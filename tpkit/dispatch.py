"""The base of the course's measuring modes (ledger, gathered-weight watch, timeline, issue log).

PyTorch wraps a TorchDispatchMode's `__torch_dispatch__` in `torch._disable_dynamo`, which imports
torch._dynamo (about 2 s of CPU) on the first op the mode sees, in every process. The course never runs
torch.compile under these modes, so they opt out of the wrapper and start in milliseconds.

A collective's end is not an op the mode sees: it is the return of `Work.wait()`. A mode that defines
`on_wait(work, started, returned)` sees every wait that returns while it is active (perf_counter times);
the wrapper is installed on enter and removed on exit, in one place for every mode.
"""
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MeasuringMode(TorchDispatchMode):
    on_wait = None          # a subclass's on_wait(work, started, returned)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __enter__(self):
        if self.on_wait is not None:
            work_cls = torch._C._distributed_c10d.Work
            self._unwrapped_wait = inner = work_cls.wait
            hook = self.on_wait

            def wait(work, *args, **kwargs):
                started = time.perf_counter()
                out = inner(work, *args, **kwargs)
                hook(work, started, time.perf_counter())
                return out

            wait.on_wait, wait.inner = hook, inner   # for a Work subclass that waits itself (launch.course_pg)
            work_cls.wait = wait
        return super().__enter__()

    def __exit__(self, *exc):
        if self.on_wait is not None:
            torch._C._distributed_c10d.Work.wait = self._unwrapped_wait
        return super().__exit__(*exc)
