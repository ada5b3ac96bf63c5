"""Memory probes and formulas: parameter bytes, activation bytes autograd saves, Korthikanti Table 2."""
from __future__ import annotations

import torch



# -- activation memory (what autograd keeps for backward) ------------------------------------------
def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def saved_activation_bytes(fn, *params) -> int:
    """Bytes of the distinct tensors autograd saves while `fn()` runs, parameters excluded.

    Distinct = by storage (a view of a saved tensor is not counted twice). Parameters are
    weights, not activations; the paper's count leaves them out too.
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def korthikanti_bytes(s, b, h, a, t=1, mode="none") -> float:
    """Table 2 of Korthikanti et al. 2022, bytes per layer (16-bit activations, 1-byte dropout masks)."""
    att = 5 * a * s / h
    per = {"none": 34 + att, "tp": 10 + 24 / t + att / t, "sp": 34 / t + att / t}[mode]
    return s * b * h * per


def course_bytes(s, b, h, ffn, a, hs, t=1, mode="none") -> float:
    """What `saved_activation_bytes` should find for one `tpkit.models.DecoderLayer` (fp32, no dropout).

    Per norm: input, x/rms (s b h each), 1/rms (s b); then the normed, weighted input of each column group
    (s b h, shared by q/k/v or by gate/up). Attention: rotated q, k and v repeated to all a heads (s b h each:
    GQA saves full-head k/v), softmax output (a b s^2), the input of o_proj (s b h), the causal mask (s^2
    bool), cos/sin (2 s hs). MLP (SwiGLU): gate, silu(gate), up, their product (s b F each).
    TP splits heads and FFN columns; the norm regions and the GEMM inputs stay whole on every rank. SP splits
    the norm regions too, but a column GEMM that saves its GATHERED input keeps s b h per group;
    mode="sp_regather" saves only the local block (and all-gathers it again in backward).
    """
    split = (4 * b * s * h + 4 * b * s * ffn + a * b * s * s) / t      # q, k, v, o-input, MLP, softmax
    norms = 2 * (2 * b * s * h + b * s)                                 # two norms: input, x/rms, 1/rms
    gemm_in = 2 * b * s * h                                             # input of the q/k/v and gate/up groups
    if mode in ("none", "tp"):
        elems = split + norms + gemm_in
    elif mode == "sp":
        elems = split + norms / t + gemm_in
    else:
        elems = split + (norms + gemm_in) / t
    return 4 * elems + s * s + 4 * 2 * s * hs
