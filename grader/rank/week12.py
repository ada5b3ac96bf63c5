"""Week 12 on a rank: the capstone. Call the student's ParallelDims on degree scenarios (pure data: which are
refused, and the groups of the valid ones); or train `tpkit.capstone_model.LlamaMoE` with the student's
composition in layout A, save a distributed checkpoint, build layout B from nothing and resume from it.

What a rank receives (grader/cases/week12.py, rank_inputs) is what it owns in layout A: the blocks of the
initial weights its (pp, dp, tp, ep) place holds, its data-parallel share of the token ids (first stage only)
and of the targets (last stage only), and the same data shares for layout B. Never the seed, never a weight of
layout B: those come out of the checkpoint. Each dense tensor is handed inside a model whose every other value
is NaN. The losses and weights it returns, and the switchboard's record of its collectives (grouped by the
group they ran on: tp, pp, dp, ep, edp), are judged in the trusted process against the single-device run.

The names and the rules both sides use (the mesh, the placement of every parameter, the tensor names) are here,
and the trusted side imports them."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from grader.rank.context import GradingError
from tpkit.capstone_model import CapstoneConfig, LlamaMoE
from tpkit.models import ModelConfig

LAYOUTS = ("a", "b")
KINDS = ("tp-sharded", "replicated", "experts")
LOSSES = "losses of layout {X}, step by step (last stage)"
WEIGHTS = "weights after layout {X}, {kind} (this rank's shards, flattened by dense name)"
GRAD_BYTES = "gradient bytes all-reduced over {dim} per step, layout {X} (record)"
PIPE_BYTES = "bytes sent to the neighbouring stages per step, layout {X} (record)"
STRAY = "collectives on a group that is none of tp, pp, dp, ep, edp, layout {X} (record)"


def capstone_config(cfg: dict) -> CapstoneConfig:
    return CapstoneConfig(model=ModelConfig(**cfg["model"]), **cfg["moe"])


def coords(rank: int, tp: int, pp: int, dp: int, ep: int) -> dict[str, int]:
    """The mesh (pp, dp, tp), tp fastest; ep borrows from dp: dp_i = edp_i * ep + ep_i."""
    p, rest = divmod(rank, dp * tp)
    d, t = divmod(rest, tp)
    return {"pp": p, "dp": d, "tp": t, "ep": d % ep, "edp": d // ep}


def group_of(rank: int, dim: str, tp: int, pp: int, dp: int, ep: int) -> list[int]:
    """The global ranks of `rank`'s group along `dim`: those whose other coordinates equal its own."""
    fixed = {"tp": ("pp", "dp"), "pp": ("dp", "tp"), "dp": ("pp", "tp"), "ep": ("pp", "tp", "edp"),
             "edp": ("pp", "tp", "ep")}[dim]
    me = coords(rank, tp, pp, dp, ep)
    return [r for r in range(tp * pp * dp) if all(coords(r, tp, pp, dp, ep)[k] == me[k] for k in fixed)]


def placement(name: str):
    """("tp", dim) or ("ep", 0): rank r keeps block r along dim among its group; None: replicated."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                      "gate_proj.weight", "up_proj.weight")):
        return ("tp", 0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return ("tp", 1)
    if name.endswith((".w1", ".w2")):
        return ("ep", 0)
    return None


def kind(name: str) -> str:
    place = placement(name)
    return KINDS[2] if place == ("ep", 0) else KINDS[1] if place is None else KINDS[0]


def stage_names(ccfg: CapstoneConfig, pp: int, s: int) -> list[str]:
    """The dense parameter names stage s of pp holds."""
    per = ccfg.n_blocks // pp
    names = [n for n, _ in LlamaMoE(ccfg).named_parameters()]
    keep = {f"layers.{i}." for i in range(s * per, (s + 1) * per)}
    return [n for n in names if any(n.startswith(k) for k in keep) or (s == 0 and n.startswith("embed_tokens"))
            or (s == pp - 1 and n in ("norm.weight", "lm_head.weight"))]


def block(w: torch.Tensor, name: str, c: dict, degrees: dict) -> torch.Tensor:
    """The block of dense tensor `name` that a rank at coordinates `c` holds (a view)."""
    place = placement(name)
    if place is None:
        return w
    return w.chunk(degrees[place[0]], dim=place[1])[c[place[0]]]


def flat_by_kind(pairs, X: str) -> dict:
    """{WEIGHTS name: the tensors of that kind, flattened and joined in dense-name order}."""
    out = {}
    for k in KINDS:
        parts = [t.detach().flatten() for n, t in sorted(pairs, key=lambda p: p[0]) if kind(n) == k]
        out[WEIGHTS.format(X=X.upper(), kind=k)] = torch.cat(parts) if parts else torch.zeros(0)
    return out


# -- task 1: the degrees object ----------------------------------------------------------------------------
VALID = "scenario accepted (1) or refused with ValueError (0)"


def groups_name(key: str, dim: str) -> str:
    return f"{key}: groups along {dim}, each a row of ranks"


def run_degrees(mod, cfg, inp, ctx):
    out, valid = {}, []
    for key, (tp, pp, dp, ep, world) in cfg["scenarios"].items():
        try:
            dims = mod.ParallelDims(tp, pp, dp, ep, world_size=world)
        except ValueError:
            valid.append(0)
            continue
        valid.append(1)
        if key in cfg["show_groups"]:
            got = dims.groups()
            if not isinstance(got, dict):
                raise GradingError(f"ParallelDims.groups() returned a {type(got).__name__}, not a dict")
            for dim in ("tp", "pp", "dp", "ep", "edp"):
                try:
                    out[groups_name(key, dim)] = torch.tensor(got.get(dim), dtype=torch.int64)
                except (TypeError, ValueError, RuntimeError):
                    raise GradingError(f"ParallelDims.groups()[{dim!r}] is not a list of equal-length rank "
                                       "lists") from None
    out[VALID] = torch.tensor(valid)
    return out


# -- task 2-4: train, save, resume ---------------------------------------------------------------------
def _nan_dense(ccfg: CapstoneConfig) -> LlamaMoE:
    """The dense model with every value NaN: `_fill_own` puts in what this rank was handed (layout A); layout B
    gets nothing, its weights must come out of the checkpoint."""
    model = LlamaMoE(ccfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(float("nan"))
    return model


def _fill_own(model: LlamaMoE, inp: dict, c: dict, degrees: dict):
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, piece in inp.items():
            if key.startswith("w."):
                block(params[key[2:]], key[2:], c, degrees).copy_(piece)


def _share_files(src: str, dst: str, group):
    """In a box every rank has its own folder: this stands in for a shared filesystem. Every rank's checkpoint
    files, gathered to every rank (through the switchboard, recorded in the phase "checkpoint")."""
    mine = {}
    for root, _, files in os.walk(src):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                mine[os.path.relpath(path, src)] = fh.read()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for files in everyone:
        for rel, data in (files or {}).items():
            path = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)


def _train(mod, stage, opt, inp, X, n_steps, cfg, dims, groups, last):
    losses = []
    ids, tgt = inp.get(f"ids_{X}"), inp.get(f"tgt_{X}")
    C = cfg["model"]["hidden_size"]
    act = (cfg["batch"] // (dims.dp * cfg["n_micro"]), cfg["seq"], C)
    for i in range(n_steps):
        loss = mod.train_step(stage, None if ids is None else ids[i], None if tgt is None else tgt[i],
                              cfg["n_micro"], act, dims, groups)
        opt.step()
        opt.zero_grad()
        if last:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise GradingError(f"train_step returned {type(loss).__name__} on the last stage; expected the loss "
                                   "(a one-element tensor)")
            losses.append(loss.detach().reshape(()))
    return {LOSSES.format(X=X.upper()): torch.stack(losses)} if last else {}


def _shards(stage):
    pairs = stage.shards()
    if not isinstance(pairs, list) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                              and isinstance(p[1], torch.Tensor) for p in pairs):
        raise GradingError("Stage.shards() must return a list of (dense name, tensor) pairs")
    return pairs


def run_capstone(mod, cfg, inp, ctx):
    if ctx.world_size != dist.get_world_size():
        raise GradingError("the capstone check runs on the whole job (t = world size)")
    rank, ccfg, out = dist.get_rank(), capstone_config(cfg), {}
    for X in LAYOUTS:
        tp, pp, dp, ep = cfg[X]
        c, degrees = coords(rank, tp, pp, dp, ep), {"tp": tp, "ep": ep}
        ctx.phase("checkpoint" if X == "b" else "layout_a")      # layout B is built and loaded from the checkpoint
        dims = mod.ParallelDims(tp, pp, dp, ep, world_size=ctx.world_size)
        groups = mod.build_groups(dims)
        dense = _nan_dense(ccfg).to(ctx.device)
        if X == "a":
            _fill_own(dense, inp, c, degrees)
        stage = mod.Stage(dense, dims, groups)
        opt = torch.optim.SGD(stage.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
        if X == "b":
            step = mod.load_checkpoint(load_dir, stage, opt, dims, groups)
            if int(step) != cfg["steps_a"]:
                raise GradingError(f"load_checkpoint returned step {step}; the checkpoint was saved after step "
                                   f"{cfg['steps_a']}")
        ctx.phase(f"layout_{X}")
        out.update(_train(mod, stage, opt, inp, X, cfg[f"steps_{X}"], cfg, dims, groups, c["pp"] == pp - 1))
        out.update(flat_by_kind(_shards(stage), X))
        if X == "a" and cfg["steps_b"]:
            ctx.phase("checkpoint")
            save_dir, load_dir = tempfile.mkdtemp(prefix="ckpt_save_"), tempfile.mkdtemp(prefix="ckpt_load_")
            mod.save_checkpoint(save_dir, stage, opt, cfg["steps_a"], dims, groups)
            _share_files(save_dir, load_dir, ctx.group)
        if not cfg["steps_b"]:
            break
    return out
