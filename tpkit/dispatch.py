"""The base of the course's measuring modes (ledger, gathered-weight watch, timeline).

PyTorch wraps a TorchDispatchMode's `__torch_dispatch__` in `torch._disable_dynamo`, which imports
torch._dynamo (about 2 s of CPU) on the first op the mode sees, in every process. The course never runs
torch.compile under these modes, so they opt out of the wrapper and start in milliseconds.
"""
from torch.utils._python_dispatch import TorchDispatchMode


class MeasuringMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
