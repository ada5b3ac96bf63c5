"""Pipeline schedules executed as data: simulate them, measure their bubble, split a model into stages.

A schedule is one list of actions per pipeline rank (stage). An action is a tuple
`(kind, mb)` or `(kind, mb, chunk)`: kind "F" (forward) or "B" (backward) of micro-batch
`mb`, on model chunk `chunk` (0 unless interleaved: rank r holds chunks r, r+p, r+2p, ...).
The schedules themselves (GPipe, 1F1B, interleaved, ZB-H1) are `reference.schedules`.

Split backward (zero-bubble schedules, Qi et al. 2023): a schedule that contains a "W" action
splits every backward in two: ("B", mb) computes only the input gradient (costs t_b) and
("W", mb) the weight gradient (costs t_w), after B(mb) on the same stage. A schedule without
any "W" action is simulated exactly as before: "B" is the whole backward.

`simulate` executes the lists as a real pipeline would: each rank runs its list in order,
and an action starts when its rank is free and its inputs exist:
    F(mb) on virtual stage s   needs F(mb) on s-1 finished           (the activation)
    B(mb) on virtual stage s   needs F(mb) on s and B(mb) on s+1     (the stored input, the grad)
    W(mb) on virtual stage s   needs B(mb) on s                      (split backward only)
With every F costing t_f and every B costing t_b, GPipe and 1F1B take (m + p - 1)(t_f + t_b),
so the idle ("bubble") fraction of the step is (p-1)/(m+p-1) (Huang et al. 2019; Narayanan
et al. 2021, Sec. 2.2). Interleaving v chunks per rank shrinks it to (p-1)/(v m + p - 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class Timeline:
    """What `simulate` measured. `events[r]` = [(start, end, kind, mb, chunk)] on rank r."""
    p: int
    m: int
    v: int
    events: list[list[tuple]] = field(default_factory=list)
    makespan: float = 0.0
    busy: list[float] = field(default_factory=list)
    peak_in_flight: list[int] = field(default_factory=list)   # stored activations (micro-batch x chunk)
    split: bool = False                 # the schedule splits backward into B (input grad) and W (weight grad)
    stuck: tuple | None = None          # (rank, position, action, what it waits for) of a deadlock
    problems: list[str] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total time, summed over ranks."""
        return sum(self.idle) / (self.p * self.makespan) if self.makespan else 0.0


def normalize_action(a) -> tuple:
    """('F'|'B'|'W', mb[, chunk]) -> (kind, mb, chunk); a ValueError that says the format otherwise."""
    if not isinstance(a, (tuple, list)) or len(a) not in (2, 3) or a[0] not in ("F", "B", "W"):
        raise ValueError(f"an action must be ('F'|'B'|'W', mb) or ('F'|'B'|'W', mb, chunk); got {a!r}")
    return (a[0], int(a[1]), int(a[2]) if len(a) == 3 else 0)


def simulate(schedule, m: int | None = None, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float = 1.0) -> Timeline:
    """Execute per-rank action lists with F costing t_f and B costing t_b (per chunk: /v).

    If the schedule contains "W" actions, B is the input-gradient half of the backward (t_b) and W the
    weight-gradient half (t_w); a micro-batch's activations stay in flight from its F until its W.
    Without "W" actions, t_w is unused and B is the whole backward, freeing the activations.

    Never raises on a bad schedule: missing, duplicated or unknown actions go to
    `problems`, and a dependency that can never be met stops the simulation with `stuck`.
    """
    p = len(schedule)
    acts = [[normalize_action(a) for a in row] for row in schedule]
    if m is None:
        m = 1 + max((a[1] for row in acts for a in row), default=-1)
    split = any(a[0] == "W" for row in acts for a in row)
    tl = Timeline(p=p, m=m, v=v, events=[[] for _ in range(p)], busy=[0.0] * p, peak_in_flight=[0] * p,
                  split=split)
    kinds = "FBW" if split else "FB"
    for r, row in enumerate(acts):
        want = {(k, i, c) for k in kinds for i in range(m) for c in range(v)}
        seen = {}
        for a in row:
            seen[a] = seen.get(a, 0) + 1
        for a in sorted(want - set(seen)):
            tl.problems.append(f"stage {r} never runs {a[0]}(mb {a[1]}" + (f", chunk {a[2]})" if v > 1 else ")"))
        for a, n in sorted(seen.items()):
            if a not in want:
                tl.problems.append(f"stage {r} runs {a} which is outside m={m}, v={v}")
            elif n > 1:
                tl.problems.append(f"stage {r} runs {a[0]}(mb {a[1]}) {n} times")
    cost = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    frees = "W" if split else "B"           # the action after which a micro-batch's activations are gone
    n_virtual = p * v
    done: dict[tuple, float] = {}           # (kind, mb, virtual stage) -> finish time
    pos, clock, live = [0] * p, [0.0] * p, [0] * p

    def needs(r, a):
        kind, mb, c = a
        vs = c * p + r
        if kind == "F":
            return [("F", mb, vs - 1)] if vs > 0 else []
        if kind == "W":
            return [("B", mb, vs)]
        return [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs < n_virtual - 1 else [])

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                deps = needs(r, a)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + cost[a[0]]
                done[(a[0], a[1], a[2] * p + r)] = end
                tl.events[r].append((start, end, *a))
                clock[r], tl.busy[r] = end, tl.busy[r] + cost[a[0]]
                live[r] += 1 if a[0] == "F" else -1 if a[0] == frees else 0
                tl.peak_in_flight[r] = max(tl.peak_in_flight[r], live[r])
                pos[r] += 1
                progress = True
    blocked = [r for r in range(p) if pos[r] < len(acts[r])]
    if blocked:
        # follow "r waits for r2" to the root: a rank waiting on itself, or the first rank seen twice
        r, seen = blocked[0], set()
        while r not in seen:
            seen.add(r)
            a = acts[r][pos[r]]
            kind, mb, vs = [d for d in needs(r, a) if d not in done][0]
            if vs % p == r or pos[vs % p] >= len(acts[vs % p]):
                break
            r = vs % p
        a = acts[r][pos[r]]
        kind, mb, vs = [d for d in needs(r, a) if d not in done][0]
        tl.stuck = (r, pos[r], a, (kind, mb, vs % p))
        where = "the same stage, earlier in its list," if vs % p == r else f"stage {vs % p}"
        tl.problems.append(
            f"stage {r} is stuck at its action #{pos[r]} {a[0]}(mb {a[1]}): it needs {kind}(mb {mb}) on "
            f"{where} first, which never comes (a dependency violation: the ranks wait on each other)")
    tl.makespan = max(clock) if any(clock) else 0.0
    return tl


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a flushed pipeline step: (p-1)/(v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def plot_schedule(tl: Timeline, ax=None, title: str = ""):
    """One row per rank, forwards blue and backwards orange, micro-batch number on each box."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * tl.p + 0.9))
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    if getattr(tl, "split", False):
        colors["W"] = "#55A868"
    for r, evs in enumerate(tl.events):
        boxes: dict[tuple, list] = {}      # (kind, odd chunk) -> its (start, width) on this row: one artist each
        for start, end, kind, mb, chunk in evs:
            boxes.setdefault((kind, chunk % 2), []).append((start, end - start))
            if end - start >= 0.45:
                ax.text((start + end) / 2, r, str(mb), ha="center", va="center", fontsize=7, color="white")
        for (kind, odd), spans in boxes.items():
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colors[kind], edgecolor="white", alpha=0.6 if odd else 1.0)
    ax.set_yticks(range(tl.p), [f"stage {r}" for r in range(tl.p)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.makespan)
    ax.set_xlabel("time (units of one forward)")
    ax.set_title(title or f"p={tl.p}, m={tl.m}: bubble {tl.bubble_fraction:.1%} "
                          f"(formula {bubble_formula(tl.p, tl.m, tl.v):.1%})")
    labels = ["forward", "backward"] if len(colors) == 2 else ["forward", "backward: input grad (B)", "weight grad (W)"]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=labels, loc="lower right", fontsize=7)
    return ax


# -- splitting the course model into stages (the lab's checker and the lecture use the same split) --
class Stage(nn.Module):
    """Layers [lo, hi) of a ForCausalLM; stage 0 also embeds ids, the last stage norms and projects.

    `full_name(n)` maps a parameter name of this stage to its name in the dense model."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.lo = lo
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        if self.embed_tokens is not None and not x.is_floating_point():
            x = self.embed_tokens(x)                       # (B, T) ids -> (B, T, C)
        for layer in self.layers:
            x = layer(x)                                   # (B, T, C)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))                 # (B, T, V)
        return x

    def full_name(self, n: str) -> str:
        head, _, rest = n.partition(".")
        if head == "layers":
            i, _, rest = rest.partition(".")
            return f"model.layers.{self.lo + int(i)}.{rest}"
        return n if head == "lm_head" else f"model.{n}"


def stage_bounds(n_layers: int, p: int, s: int) -> tuple[int, int]:
    """Contiguous, equal split of the layers (n_layers % p == 0)."""
    if n_layers % p:
        raise ValueError(f"{n_layers} layers do not split into {p} equal stages")
    k = n_layers // p
    return s * k, (s + 1) * k


def split_stage(model, p: int, s: int) -> Stage:
    lo, hi = stage_bounds(model.config.num_hidden_layers, p, s)
    return Stage(model, lo, hi, first=s == 0, last=s == p - 1)


def stage_param_names(model, p: int, s: int) -> list[str]:
    st = split_stage(model, p, s)
    return [st.full_name(n) for n, _ in st.named_parameters()]


# -- measuring a real pipeline: when did each stage compute? -------------------------------------
class _Mark(torch.autograd.Function):
    """Identity; its backward records a timestamp (the start or the end of a stage's backward)."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import time
        ctx.log.append((ctx.tag, time.perf_counter()))
        return g, None, None


class TimedStage(nn.Module):
    """Wraps a stage: logs (kind, mb, start, end) of every forward and backward with perf_counter
    (CLOCK_MONOTONIC: comparable across processes of one machine) and the activations in flight."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage, self.events, self._marks, self._n, self.peak_in_flight = stage, [], [], 0, 0

    def reset(self):
        self.events, self._n, self.peak_in_flight = [], 0, 0
        self._marks.clear()

    def forward(self, x):
        import time
        mb, self._n = self._n, self._n + 1
        t0 = time.perf_counter()
        if not x.is_floating_point() and getattr(self.stage, "embed_tokens", None) is not None:
            x = self.stage.embed_tokens(x)                     # ids have no grad: mark after the embedding
        x = _Mark.apply(x, self._marks, ("B_end", mb))         # runs last in this stage's backward
        y = self.stage(x)
        self.events.append(("F", mb, t0, time.perf_counter()))
        # stored activations: forwards so far minus backwards started so far
        started_b = sum(1 for (k, _), _t in self._marks if k == "B_start")
        self.peak_in_flight = max(self.peak_in_flight, mb + 1 - started_b)
        return _Mark.apply(y, self._marks, ("B_start", mb))   # runs first in this stage's backward

    def finish(self) -> list[tuple]:
        """Pair the backward marks into ("B", mb, start, end) events; call after the step."""
        starts = {mb: t for (k, mb), t in self._marks if k == "B_start"}
        ends = {mb: t for (k, mb), t in self._marks if k == "B_end"}
        for mb, t0 in starts.items():
            self.events.append(("B", mb, t0, ends.get(mb, t0)))
        self._marks.clear()
        return sorted(self.events, key=lambda e: e[2])


def measured_timeline(events_per_rank: list[list[tuple]], m: int) -> Timeline:
    """A Timeline from measured (kind, mb, start, end) events, t = 0 at the first start."""
    t0 = min(e[2] for evs in events_per_rank for e in evs)
    p = len(events_per_rank)
    tl = Timeline(p=p, m=m, v=1, events=[[(s - t0, e - t0, k, mb, 0) for k, mb, s, e in evs]
                                         for evs in events_per_rank])
    tl.makespan = max(ev[1] for evs in tl.events for ev in evs)
    tl.busy = [sum(ev[1] - ev[0] for ev in evs) for evs in tl.events]
    return tl
