"""Bytes per step and dimension: measured by a ledger that knows the groups, and derived from the earlier weeks'
counts (week 12 §5)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.capstone.layout import ParallelDims
from tpkit.capstone_model import CapstoneConfig, LlamaMoE, MoELayer
from tpkit.ledger import CommLedger


class DimLedger(CommLedger):
    """The course's ledger (tpkit.ledger) over several groups at once: each entry names the mesh dimension of
    the process group it ran on (by the group's name, so two groups over the same ranks, dp and ep, stay apart)
    and counts its ring bytes for that group's size."""

    def __init__(self, groups: dict):
        super().__init__()
        self.dim_of = {g.group_name: dim for dim, (g, _) in groups.items()}

    def _entry(self, op, args, functional=False):
        pg = next(dist.ProcessGroup.unbox(a) for a in args
                  if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        self.group_size = pg.size()           # the ledger's byte formulas take the size of this op's group
        entry = super()._entry(op, args, functional)
        entry["dim"] = self.dim_of.get(pg.group_name, "other")
        return entry

    def per_dim(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.entries:
            out[e["dim"]] = out.get(e["dim"], 0.0) + e["sent"]
        return out


def moe_tokens_experts(cfg: CapstoneConfig, seed: int, ids) -> torch.Tensor:
    """The experts (B, T, k) the dense model's MoE layer picks for every token of `ids` at initialisation."""
    from tpkit.capstone_model import init_capstone
    model, seen = init_capstone(LlamaMoE(cfg), seed), {}
    moe = next(m for m in model.modules() if isinstance(m, MoELayer))
    moe.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]))
    with torch.no_grad():
        model(ids)
        n = moe.norm(seen["x"])                                                   # (B, T, C)
        return (n @ moe.router.T).softmax(-1).topk(cfg.top_k, dim=-1).indices               # (B, T, k)


def expected_bytes(cfg: CapstoneConfig, dims: ParallelDims, rank: int, batch: int, seq: int, n_micro: int,
                   experts_of_tokens=None) -> dict[str, float]:
    """Bytes one rank sends in one step, per dimension, from the counts the earlier weeks derived (float32):
    tp  (Week 5) 8(t-1)/t N per dense layer per micro-batch under SP (2 AG + 2 RS forward, their conjugates
        backward), N = b*T*C*4 the full activation; the embedding's RS and the head's AG, each with its conjugate:
        2(t-1)/t N each; (Week 4) 3 all-reduces of (b, T) for the loss; and once per step the all-reduce of the
        replicated weights' partial gradients (norms, router, experts: SP's tokens were split over tp);
    pp  (Week 9) one activation (b, T/t, C) forward and one gradient back per micro-batch and stage boundary;
    dp  (Week 1's ring) 2(d-1)/d of every gradient the plan sums over dp, plus the loss (last stage);
    edp the same for the experts over their replicas (edp = dp / ep ranks);
    ep  (Week 11) the counts all-to-all, (ep-1)/ep * E int64 per micro-batch, and the rows: dispatch, combine and
        their backward send 2 (out + in) rows of C floats, out = assignments of my tokens to other ranks' experts,
        in = the other ranks' assignments to mine (from the dense model's routing, `experts_of_tokens` (B, T, k))."""
    c, t, d, m = dims.coords(rank), dims.tp, dims.dp, cfg.model
    C, E, Fe = m.hidden_size, cfg.n_experts, cfg.expert_size
    b = batch // (d * n_micro)                                                   # sequences per micro-batch
    N = b * seq * C * 4
    per = cfg.n_blocks // dims.pp
    blocks = range(c["pp"] * per, (c["pp"] + 1) * per)
    first, last, moe_here = c["pp"] == 0, c["pp"] == dims.pp - 1, cfg.n_blocks - 1 in blocks
    n_dense = len(blocks) - moe_here
    ring = lambda n, size: 2 * (size - 1) / size * n                             # noqa: E731 (all-reduce)
    # local parameter counts of this stage, by how the gradient plan reduces them
    sharded = (m.vocab_size * C // t) * (first + last) + n_dense * (
        (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim * C + C * C + 3 * C * m.intermediate_size) // t
    replicated = 2 * C * n_dense + C * last + (C + E * C) * moe_here             # norms, final norm, MoE norm, router
    experts = 2 * (E // dims.ep) * Fe * C * moe_here
    tp = n_micro * (n_dense * 8 * (t - 1) / t * N + (first + last) * 2 * (t - 1) / t * N
                    + last * 3 * ring(b * seq * 4, t))
    if dims.sp:
        tp += ring(4 * (replicated + experts), t)
    out = {"tp": tp, "pp": n_micro * b * (seq // (t if dims.sp else 1)) * C * 4 * ((not last) + (not first)),
           "dp": ring(4 * (sharded + replicated), d) + last * ring(4, d), "edp": ring(4 * experts, dims.edp), "ep": 0.0}
    if moe_here and dims.ep > 1:
        def owners(q):      # the ep index owning each assignment of the tokens of the rank at dp index q (my tp block)
            rows = experts_of_tokens[q * (batch // d):(q + 1) * (batch // d)]
            if dims.sp:
                rows = rows[:, c["tp"] * seq // t:(c["tp"] + 1) * seq // t]
            return rows.flatten() // (E // dims.ep)
        peers = [c["edp"] * dims.ep + e for e in range(dims.ep) if e != c["ep"]]
        out_rows = int((owners(c["dp"]) != c["ep"]).sum())
        in_rows = sum(int((owners(q) == c["ep"]).sum()) for q in peers)
        out["ep"] = n_micro * (dims.ep - 1) / dims.ep * E * 8 + 2 * (out_rows + in_rows) * C * 4
    return out
