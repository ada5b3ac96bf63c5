"""Pipeline schedules as data (the Week 9 lab's answers): one list of actions per stage.

An action is `(kind, mb)` or `(kind, mb, chunk)`: "F" or "B" of micro-batch `mb` on model chunk
`chunk`. `tpkit.pipeline.simulate` executes them and measures the bubble.
"""
from __future__ import annotations




def gpipe(p: int, m: int) -> list[list[tuple]]:
    """All forwards, then all backwards (GPipe, Huang et al. 2019): m activations in flight."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[tuple]]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank s runs p-s-1 warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards.
    At most p - s micro-batches are in flight on rank s (GPipe: m)."""
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:                       # steady state: one forward, one backward
            acts += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        acts += [("B", i) for i in range(b, m)]  # cool-down
        out.append(acts)
    return out


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[tuple]]:
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2): v chunks per rank, m % p == 0.

    Micro-batches go through the chunks in groups of p: rank r runs forwards of mbs 0..p-1 on
    chunk 0, then the same mbs on chunk 1, ...; backwards walk the chunks in reverse.
    Warm-up: (p - r - 1) * 2 + (v - 1) * p forwards (Megatron-LM's count)."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m % p == 0 (m={m}, p={p})")
    total = m * v

    def fwd(k):        # k-th forward on a rank -> (mb, chunk)
        grp, within = divmod(k, p * v)
        return grp * p + within % p, within // p

    def bwd(k):
        mb, c = fwd(k)
        return mb, v - 1 - c

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [("F", *fwd(k)) for k in range(warm)]
        f, b = warm, 0
        while f < total:
            acts += [("F", *fwd(f)), ("B", *bwd(b))]
            f, b = f + 1, b + 1
        acts += [("B", *bwd(k)) for k in range(b, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2023, Sec. 2.1): 1F1B with the backward split into B (input grad) and
    W (weight grad). Rank s runs the same p-s-1 warm-up forwards as 1F1B, then s more (F, B)
    pairs whose W it postpones, then (F, B, W) triples; the cool-down alternates B and W and
    ends with the postponed W's. A micro-batch stays in flight until its W, so every rank holds
    at most p of them: the first rank's peak, the same as 1F1B's (1F1B: p - s on rank s).
    Rank s postpones s W's, so the later stages carry the most into the cool-down: they fill the time
    in which 1F1B leaves those stages idle at the end of the step while the last gradients travel back
    to the first stages. Rank 0 postpones none; its waits shrink because a gradient now travels back one
    B (not B + W) per stage."""
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [("F", i) for i in range(warm)]
        f, b, w = warm, 0, 0
        while f < m:                                   # steady state
            acts += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
            if b - w > s:                              # more than s W's pending: run the oldest
                acts.append(("W", w))
                w += 1
        while b < m:                                   # cool-down: one B, then one W
            acts.append(("B", b))
            b += 1
            if w < b:
                acts.append(("W", w))
                w += 1
        acts += [("W", i) for i in range(w, m)]
        out.append(acts)
    return out
