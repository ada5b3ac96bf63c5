"""The degrees of one layout, its mesh and every process group it implies (week 12 §1)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tpkit.capstone_model import CapstoneConfig


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one layout. The mesh is (pp, dp, tp), slowest to fastest: rank = (pp_i * dp + dp_i) * tp + tp_i.
    The experts' ranks are carved out of dp (torchtitan's "EP borrows from dp_shard"): dp_i = edp_i * ep + ep_i,
    `edp` = dp / ep replicas of each expert shard."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    sp: bool = False               # sequence parallelism inside the TP group (Korthikanti et al. 2022)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism borrows data-parallel ranks")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def validate(self, cfg: CapstoneConfig, batch: int, seq: int, n_micro: int, world: int):
        """Every divisibility the layout needs, each with the reason; raises ValueError on the first broken."""
        if self.world != world:
            raise ValueError(f"{self}: tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world} must be the world "
                             f"size {world}: every rank has one place in the mesh")
        m = cfg.model
        need = [(m.num_key_value_heads, self.tp, "tp must divide the kv heads (each rank keeps whole heads)"),
                (m.intermediate_size, self.tp, "tp must divide the FFN width (column-parallel)"),
                (m.vocab_size, self.tp, "tp must divide the vocabulary (vocab-parallel embedding and head)"),
                (cfg.n_blocks, self.pp, f"pp must divide the {cfg.n_blocks} blocks (equal stages)"),
                (cfg.n_experts, self.ep, "ep must divide the experts"),
                (batch, self.dp * n_micro, "dp * n_micro must divide the batch (equal micro-batches)")]
        if self.sp:
            need.append((seq, self.tp, "under SP, tp must divide the sequence"))
        for n, d, why in need:
            if n % d:
                raise ValueError(f"{self}: {why} ({n} % {d} != 0)")

    def coords(self, rank: int) -> dict[str, int]:
        p, rest = divmod(rank, self.dp * self.tp)
        d, t = divmod(rest, self.tp)
        return {"pp": p, "dp": d, "tp": t, "ep": d % self.ep, "edp": d // self.ep}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of every dimension, as lists of global ranks: a group varies one coordinate, the others
        fixed. ep and edp split dp: ep varies ep_i (same edp_i), edp varies edp_i (same ep_i)."""
        fixed = {"tp": ("pp", "dp"), "pp": ("dp", "tp"), "dp": ("pp", "tp"), "ep": ("pp", "tp", "edp"),
                 "edp": ("pp", "tp", "ep")}
        out = {}
        for dim, keep in fixed.items():
            groups: dict[tuple, list[int]] = {}
            for r in range(self.world):
                c = self.coords(r)
                groups.setdefault(tuple(c[k] for k in keep), []).append(r)
            out[dim] = list(groups.values())
        return out


def build_groups(dims: ParallelDims, rank: int) -> dict[str, tuple]:
    """{dim: (group, ranks)} of this rank, for tp, pp, dp, ep, edp. `new_group` is collective over the whole
    world: every rank makes every group, in the same order, and keeps its own."""
    mine = {}
    for dim, groups in dims.all_groups().items():
        for ranks in groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = (g, ranks)
    return mine
