"""Week 8: watch gathered weights on one rank: how many full weights are alive at once, and whether any is
saved for backward.

Generalized TP / ZeRO-3 keeps each weight 1/t per rank and materialises the full weight only around its
GEMM. The memory claim "shard + at most two gathered weights (the one in use, the one being prefetched)"
is measured here, not trusted:

- every all-gather into one tensor is watched at the dispatcher: the c10d ops `_allgather_base_` (what
  `dist.all_gather_single` and its deprecated alias `dist.all_gather_into_tensor` run) and
  `allgather_into_tensor_coalesced_`, whose output is their first argument, and the functional
  `_c10d_functional.all_gather_into_tensor` (functional collectives, DTensor), whose output is returned;
- each such output buffer is tracked with a weak reference: when the code drops its last reference,
  the buffer is freed and the weak reference dies (a buffer whose storage is resized to 0, as FSDP2
  frees, counts as freed too). At each new all-gather we count the tracked buffers still alive, plus
  the new one: that is the peak number of full weights held;
- a saved_tensors hook sees every tensor autograd keeps for backward; one sharing storage with a live
  gathered buffer means a full weight is pinned from forward to backward (ZeRO-3 re-gathers instead).

What it does not see: a weight gathered with the list form, `dist.all_gather` (c10d `allgather_`), and
concatenated afterwards (the lab asks for `dist.all_gather_single`), or allocator-level fragmentation.
"""
from __future__ import annotations

import weakref

import torch
from tpkit.dispatch import MeasuringMode

_GATHER_OUT_ARG = {"_allgather_base_", "allgather_into_tensor_coalesced_"}   # c10d ops: output is args[0]
_GATHER_RETURNS = {"all_gather_into_tensor"}                                  # functional: output is returned


class GatherWatch(MeasuringMode):
    def __init__(self):
        super().__init__()
        self._live: list[tuple[weakref.ref, int, int]] = []   # (ref, storage ptr, bytes)
        self.peak_count = 0
        self.peak_bytes = 0
        self.saved_full = 0
        self.gathers = 0

    def _alive(self):
        """Buffers still holding memory: not garbage-collected and not resized to 0 (FSDP2 frees that way)."""
        def holds(ref):
            t = ref()
            try:
                return t is not None and t.untyped_storage().nbytes() > 0
            except Exception:      # noqa: BLE001
                return t is not None
        self._live = [e for e in self._live if holds(e[0])]
        return self._live

    def _track(self, out: torch.Tensor):
        alive = self._alive()
        self.gathers += 1
        nbytes = out.numel() * out.element_size()
        count = len(alive) + 1
        self.peak_count = max(self.peak_count, count)
        self.peak_bytes = max(self.peak_bytes, sum(b for _, _, b in alive) + nbytes)
        try:
            ptr = out.untyped_storage().data_ptr()
        except Exception:      # noqa: BLE001
            ptr = -1
        self._live.append((weakref.ref(out), ptr, nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        out = func(*args, **kwargs)
        if func.namespace == "c10d" and name in _GATHER_OUT_ARG and args:
            outs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self._track(o)
        elif func.namespace == "_c10d_functional" and name in _GATHER_RETURNS and isinstance(out, torch.Tensor):
            self._track(out)
        return out

    # saved-for-backward check -------------------------------------------------------
    def _pack(self, t):
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:      # noqa: BLE001
            return t
        if any(p == ptr and p != -1 for _, p, _ in self._alive()):
            self.saved_full += 1
        return t

    def saved_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
