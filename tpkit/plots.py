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

EMPTY = 0


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


def latency_plot(sizes_bytes, seconds, fit=None, label="measured", ax=None, extra_lines=(), title=""):
    """Log-log latency vs message size. fit: callable bytes -> seconds. extra_lines: (x, y, label, style)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.loglog(sizes_bytes, [s * 1e6 for s in seconds], "o", label=label)
    if fit is not None:
        ax.loglog(sizes_bytes, [fit(b) * 1e6 for b in sizes_bytes], "-", label="alpha-beta fit")
    for x, y, lab, style in extra_lines:
        ax.loglog(x, [v * 1e6 for v in y], style, label=lab)
    ax.set_xlabel("tensor size N (bytes)")
    ax.set_ylabel("time per all_reduce (µs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _matrix(ax, x0, shape, split, t, kind, label):
    """Draw a (rows, cols) matrix at x0: split None|'rows'|'cols'; kind 'own'|'replicated'|'partial'."""
    h, w = shape
    for r in range(t if split else 1):
        if split == "rows":
            box = (x0, h - (r + 1) * h / t, w, h / t)
        elif split == "cols":
            box = (x0 + r * w / t, 0, w / t, h)
        else:
            box = (x0, 0, w, h)
        if kind == "replicated":
            ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor="0.8", edgecolor="k", lw=0.8))
        elif kind == "partial":                         # every rank holds a full-size partial sum
            for k in range(t):
                ax.add_patch(Rectangle((box[0] + k * box[2] / t, box[1]), box[2] / t, box[3],
                                       facecolor=rank_color(k), alpha=0.6, edgecolor="none"))
            ax.add_patch(Rectangle(box[:2], box[2], box[3], fill=False, edgecolor="k", lw=0.8))
        else:
            ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor=rank_color(r), edgecolor="k", lw=0.8))
            ax.text(box[0] + box[2] / 2, box[1] + box[3] / 2, f"{r}", ha="center", va="center", fontsize=8,
                    color="white", fontweight="bold")
    ax.text(x0 + w / 2, h + 0.4, label, ha="center", va="bottom", fontsize=9)


def tp_blocks_figure(t: int = 4, batch: float = 2.0, d_in: float = 4.0, d_out: float = 4.0):
    """Which rank holds which block of X (B, in), W (out, in) and Y (B, out) in column- and row-parallel
    linear layers. Colour = the rank that holds the block; grey = replicated on every rank;
    striped = every rank holds a different partial sum of the same full-size block."""
    fig, axes = plt.subplots(2, 1, figsize=(8.2, 5.0))
    layouts = [
        ("column-parallel: W split by output features (rows); Y_r = X W_r^T is local",
         [("X (B, in): replicated", (batch, d_in), None, "replicated"),
          ("W (out, in): row blocks", (d_out, d_in), "rows", "own"),
          ("Y (B, out): column blocks", (batch, d_out), "cols", "own")]),
        ("row-parallel: W split by input features (columns); Y = Σ_r X_r W_r^T needs an all-reduce",
         [("X (B, in): column blocks", (batch, d_in), "cols", "own"),
          ("W (out, in): column blocks", (d_out, d_in), "cols", "own"),
          ("X_r W_r^T: partial sums", (batch, d_out), None, "partial"),
          ("Y after all-reduce", (batch, d_out), None, "replicated")]),
    ]
    for ax, (title, mats) in zip(axes, layouts):
        x0 = 0.0
        for label, shape, split, kind in mats:
            _matrix(ax, x0, shape, split, t, kind, label)
            x0 += shape[1] + 1.6
        ax.set_xlim(-0.3, x0 - 1.0)
        ax.set_ylim(-0.3, max(d_out, batch) + 1.2)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(title, fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=rank_color(r)) for r in range(t)] + \
              [Rectangle((0, 0), 1, 1, color="0.8")]
    fig.legend(handles, [f"rank {r}" for r in range(t)] + ["every rank (replicated)"], loc="lower center",
               ncol=t + 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
