"""Training-loop profile: one small LM, same data and seed, four modes; `python -m reference.train_profile`.

Modes: `none` (the dense `tpkit.models` layers, every rank alone), `tp` (Megatron TP: all-reduces),
`tp_sp` (TP + sequence parallel: all-gather / reduce-scatter), `tp_sp_overlap` (the same with the ring
AG+GEMM / GEMM+RS of `reference.overlap`). Per step it records the loss, the global gradient norm (taken
BEFORE zero_grad: after it every grad is zero), the step time (median over steps after warm-up;
`torch.cuda.synchronize()` before each clock read on GPUs), and memory per rank: on CUDA
`torch.cuda.max_memory_allocated`; on CPU the bytes of parameters + grads + AdamW states + the tensors
autograd saved for backward (there is no CPU allocator high-water mark to read).

    python -m reference.train_profile                 # 2 ranks, 20 steps, figure + JSON in a temp dir
    python -m reference.train_profile --nproc 4 --steps 40 --out /tmp/profile
On GPUs the same run under Nsight Systems:
    nsys profile -t cuda,nvtx,osrt -o tp_profile python -m reference.train_profile --nproc 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tpkit.models import DecoderLayer, ModelConfig, RMSNorm, init_weights
from reference.sp_layers import ParallelDecoderLayer
from tpkit.memory import saved_activation_bytes

MODES = ("none", "tp", "tp_sp", "tp_sp_overlap")
CFG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4)


class ProfileLM(nn.Module):
    """Embedding -> layers -> norm -> lm_head. Embedding, final norm and head are replicated on every rank."""

    def __init__(self, cfg: ModelConfig, mode: str, group=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        dense = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init_weights(self, seed=0)
        for i, d in enumerate(dense):
            init_weights(d, seed=1 + i)                     # the same dense weights in every mode
        self.mode, self.group = mode, group
        if mode == "none":
            self.layers = nn.ModuleList(dense)
        else:
            kind = "tp" if mode == "tp" else "sp"
            self.layers = nn.ModuleList(ParallelDecoderLayer(d, group, kind, overlap=mode == "tp_sp_overlap")
                                        for d in dense)
        self.replicated = [self.embed.weight, self.norm.weight, self.head.weight]

    def forward(self, ids, targets):
        """Returns (loss of this rank's tokens as a share of the global mean, number of tokens)."""
        h = self.embed(ids)                                                    # (B, T, C)
        sp = self.mode.startswith("tp_sp")
        if sp:
            t, r = dist.get_world_size(self.group), dist.get_rank(self.group)
            h = h.chunk(t, dim=1)[r]                                           # (B, T/t, C): this rank's block
            targets = targets.chunk(t, dim=1)[r]
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))                                       # (B, T or T/t, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / ids.numel()


def batch(step, B, T, V):
    """A learnable toy language: each sequence counts up by a per-sequence stride, mod V."""
    g = torch.Generator().manual_seed(1000 + step)
    start, stride = torch.randint(0, V, (B, 1), generator=g), torch.randint(1, 4, (B, 1), generator=g)
    ids = (start + stride * torch.arange(T + 1)) % V                           # (B, T+1)
    return ids[:, :-1], ids[:, 1:]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(mode, steps, B, T, device, group=None):
    cfg = ModelConfig(**CFG)
    model = ProfileLM(cfg, mode, group).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sp = mode.startswith("tp_sp")
    replicated = {id(p) for p in model.replicated}
    if mode != "none":                  # block norm weights: whole on every rank (TP: same grads; SP: all-reduced)
        replicated |= {id(p) for n, p in model.named_parameters() if "layernorm" in n}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, norms, times, act = [], [], [], 0
    for step in range(steps):
        ids, tgt = (x.to(device) for x in batch(step, B, T, cfg.vocab_size))
        _sync(device)
        t0 = time.perf_counter()
        if step == 0:                   # count saved activations once (the hooks cost time); step 0 is warm-up
            box = {}
            act = saved_activation_bytes(lambda: box.setdefault("loss", model(ids, tgt)), *model.parameters())
            loss = box["loss"]
        else:
            loss = model(ids, tgt)
        loss.backward()
        if sp:                          # embedding/final norm/head saw T/t tokens here: sum their grads
            for p in model.replicated:
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(loss.detach(), group=group)   # the logged loss: the sum of the ranks' shares
        # global grad norm, BEFORE zero_grad; sharded grads summed over ranks, replicated ones counted once
        sq_shard = sum(p.grad.pow(2).sum() for p in model.parameters() if id(p) not in replicated)
        sq_shard = torch.as_tensor(sq_shard, dtype=torch.float32, device=device)
        if mode != "none":
            dist.all_reduce(sq_shard, group=group)
        sq_rep = sum(p.grad.pow(2).sum() for p in model.parameters() if id(p) in replicated)
        norms.append(float((sq_shard + sq_rep).sqrt()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    state = sum(p.numel() * p.element_size() * 4 for p in model.parameters())   # weights, grads, Adam m and v
    mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else state + act
    return {"loss": losses, "grad_norm": norms, "step_s": times, "median_step_s": statistics.median(times[3:]),
            "memory_bytes": int(mem), "param_bytes": int(state // 4), "activation_bytes": int(act)}


def worker(steps, B, T, out):
    from launch.dist import init_process_group
    rank, world, device = init_process_group()
    torch.set_num_threads(1)
    res = {}
    for mode in MODES:
        dist.barrier()
        r = run_mode(mode, steps, B, T, device)
        mem = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(mem, torch.tensor([float(r["memory_bytes"])], dtype=torch.float64, device=device))
        r["memory_per_rank"] = [int(m.item()) for m in mem]
        res[mode] = r
    if rank == 0:
        meta = {"world_size": world, "device": str(device), "backend": dist.get_backend(), "steps": steps,
                "B": B, "T": T, "config": CFG,
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU/gloo, this machine)"}
        with open(out, "w") as f:
            json.dump({"meta": meta, "modes": res}, f)
    dist.barrier()


def plot(data, path=None):
    import matplotlib.pyplot as plt
    modes, meta = data["modes"], data["meta"]
    fig, ax = plt.subplots(1, 4, figsize=(16, 3.6))
    for m, r in modes.items():
        ax[0].plot(r["loss"], label=m)
        ax[1].plot(r["grad_norm"], label=m)
    ax[0].set(title="loss", xlabel="step", ylabel="cross-entropy (nats)")
    ax[1].set(title="grad norm (before zero_grad)", xlabel="step", ylabel="L2 norm")
    ax[0].legend()
    names = list(modes)
    ax[2].bar(names, [modes[m]["median_step_s"] * 1e3 for m in names])
    ax[2].set(title=f"median step time ({meta['gpu'] if meta['gpu'] != 'none (CPU/gloo, this machine)' else 'CPU/gloo, this machine'})",
              ylabel="ms")
    w = 0.8 / meta["world_size"]
    for r in range(meta["world_size"]):
        ax[3].bar([i + r * w for i in range(len(names))], [modes[m]["memory_per_rank"][r] / 2**20 for m in names],
                  width=w, label=f"rank {r}")
    ax[3].set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names)
    ax[3].set(title="memory per rank" + (" (tracked bytes, CPU)" if meta["device"] == "cpu" else " (peak allocated)"),
              ylabel="MiB")
    ax[3].legend(fontsize=7)
    for a in ax[2:]:
        a.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def table(data) -> str:
    rows = [f"{'mode':<15} {'loss[0]':>8} {'loss[-1]':>8} {'max|dloss| vs none':>18} {'max|dnorm| vs none':>18} "
            f"{'median step ms':>14} {'memory/rank MiB':>16}"]
    base = data["modes"]["none"]
    for m, r in data["modes"].items():
        dl = max(abs(a - b) for a, b in zip(r["loss"], base["loss"]))
        dn = max(abs(a - b) for a, b in zip(r["grad_norm"], base["grad_norm"]))
        mem = "/".join(f"{x / 2**20:.2f}" for x in r["memory_per_rank"])
        rows.append(f"{m:<15} {r['loss'][0]:>8.4f} {r['loss'][-1]:>8.4f} {dl:>18.2e} {dn:>18.2e} "
                    f"{r['median_step_s'] * 1e3:>14.2f} {mem:>16}")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m reference.train_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default=None, help="folder for profile.json and profile.png (default: a temp dir)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.steps, a.batch, a.seq, a.worker)
        return 0
    from launch import run
    out = a.out or tempfile.mkdtemp(prefix="train-profile-")
    os.makedirs(out, exist_ok=True)
    js = os.path.join(out, "profile.json")
    res = run("reference.train_profile", a.nproc, ["--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
                                                "--worker", js], timeout=300)
    if not res.ok:
        print(res.root_cause(), file=sys.stderr)
        return 1
    data = json.load(open(js))
    print(table(data))
    plot(data, os.path.join(out, "profile.png"))
    print(f"({data['meta']['backend']}, {data['meta']['gpu']}, {a.nproc} ranks, {res.seconds:.1f} s)\nwrote {js} "
          f"and {os.path.join(out, 'profile.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
