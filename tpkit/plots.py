"""Figures for the lecture notebooks: who holds what, before and after a collective.

A rank's buffer is drawn as a row of cells, one per chunk. A chunk is described by the
set of ranks whose data it contains, encoded as a bitmask (rank r contributes 2**r), so a
sum over ranks {0, 2} is 0b101 = 5. Lectures send exactly these values through the real
collectives (rank r fills its tensor with 2**r), so the pictures are decoded from measured
tensors, not drawn by hand. A cell with several contributors is striped in their colours.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

def rank_color(r: int):
    return plt.get_cmap("tab10")(r % 10)


def contributors(mask: int) -> list[int]:
    """Bitmask -> sorted list of contributing ranks (2**r for rank r)."""
    mask = int(round(mask))
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def _label(ranks: list[int], t: int) -> str:
    if not ranks:
        return ""
    if len(ranks) == 1:
        return str(ranks[0])
    if len(ranks) == t:
        return "Σ"
    return "+".join(map(str, ranks))


def draw_buffers(ax, buffers: list[list[int]], title: str = "", t: int | None = None):
    """buffers[rank][chunk] = bitmask of contributors (0 = empty / undefined)."""
    t = t or len(buffers)
    ncols = max(len(b) for b in buffers)
    for r, row in enumerate(buffers):
        y = len(buffers) - 1 - r                         # rank 0 on top
        for j, mask in enumerate(row):
            ranks = contributors(mask)
            if not ranks:
                ax.add_patch(Rectangle((j, y), 1, 1, facecolor="white", edgecolor="0.7", hatch="//", lw=0.8))
                continue
            w = 1 / len(ranks)
            for k, src in enumerate(ranks):              # one stripe per contributor
                ax.add_patch(Rectangle((j + k * w, y), w, 1, facecolor=rank_color(src), edgecolor="none"))
            ax.add_patch(Rectangle((j, y), 1, 1, fill=False, edgecolor="k", lw=0.8))
            ax.text(j + 0.5, y + 0.5, _label(ranks, t), ha="center", va="center", fontsize=8,
                    color="white", fontweight="bold")
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, len(buffers))
    ax.set_yticks([len(buffers) - 0.5 - r for r in range(len(buffers))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(buffers))], fontsize=8)
    ax.set_xticks([j + 0.5 for j in range(ncols)])
    ax.set_xticklabels([f"c{j}" for j in range(ncols)], fontsize=7)
    ax.tick_params(length=0)
    ax.set_title(title, fontsize=9)
    ax.set_aspect("equal")


def holdings_grid(rows: list[tuple[str, list, list]], t: int, suptitle: str = "", per_row: int = 2):
    """Panels (before, after) per collective, `per_row` collectives side by side; buffers as in draw_buffers."""
    n_rows = -(-len(rows) // per_row)
    fig, axes = plt.subplots(n_rows, 2 * per_row, figsize=(2.6 * per_row * 2, 0.8 * t * n_rows + 0.9),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i, (name, before, after) in enumerate(rows):
        a_before, a_after = axes[i // per_row][2 * (i % per_row)], axes[i // per_row][2 * (i % per_row) + 1]
        for ax in (a_before, a_after):
            ax.axis("on")
        draw_buffers(a_before, before, f"{name}: before", t)
        draw_buffers(a_after, after, f"{name}: after", t)
    handles = [Rectangle((0, 0), 1, 1, color=rank_color(r)) for r in range(t)]
    fig.legend(handles, [f"data of rank {r}" for r in range(t)], loc="lower center", ncol=t, fontsize=8,
               frameon=False)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97 if suptitle else 1))
    return fig


def ring_reduce_scatter_states(t: int) -> list[list[list[int]]]:
    """Simulate a ring reduce-scatter on bitmasks: the state of every rank's t chunks after each step.

    Step s: rank r sends chunk (r - s - 1) mod t to rank r + 1, which adds it into its own copy.
    """
    state = [[1 << r for _ in range(t)] for r in range(t)]
    states = [[row[:] for row in state]]
    for s in range(t - 1):
        sent = [(r, (r - s - 1) % t, state[r][(r - s - 1) % t]) for r in range(t)]
        for r, j, mask in sent:                         # every rank sends at once, then adds
            state[(r + 1) % t][j] |= mask
        states.append([row[:] for row in state])
    return states


def ring_steps_figure(t: int = 4):
    """Panels: the ring reduce-scatter after step 0 .. t-2; chunk r of rank r ends fully reduced."""
    states = ring_reduce_scatter_states(t)
    fig, axes = plt.subplots(1, len(states), figsize=(2.1 * len(states), 2.4))
    for s, (ax, st) in enumerate(zip(axes, states)):
        draw_buffers(ax, st, "start" if s == 0 else f"after step {s - 1}", t)
        if s:
            for r in range(t):                          # outline the chunk that just arrived
                j = (r - s - 1) % t
                ax.add_patch(Rectangle((j, t - 1 - r), 1, 1, fill=False, edgecolor="k", lw=2.5))
    fig.suptitle(f"Ring reduce-scatter, t = {t}: each step every rank sends one chunk to its right "
                 "neighbour (thick: the chunk just received and added)", fontsize=9)
    fig.tight_layout()
    return fig
