"""Week 4: vocabulary-parallel embedding and cross-entropy, vs F.embedding / F.cross_entropy.

The padding rule (as Megatron pads its vocabulary to a multiple of the TP size): with V rows and t
ranks, each rank owns ceil(V/t) consecutive rows of the padded vocabulary; rank r owns global ids
[r ceil(V/t), (r+1) ceil(V/t)); ids >= V are padding. The embedding shard stores zeros there; the
cross-entropy masks padded logit columns out (each rank's slice has them filled with a large value,
PAD_LOGIT, as garbage from a padded lm_head could be, so padding that is not masked wins the max and
the softmax).

Cross-entropy (Megatron-LM core/tensor_parallel/cross_entropy.py): three all-reduces of [B, T]
tensors forward: MAX of the row max, SUM of the target logit (non-zero on the owning rank only),
SUM of the sum of exp; loss = log(sum exp) - z_target per token; backward softmax - onehot is
local. Ignored targets are handled by a loss mask (ignore_index may even be a real id), the mean
runs over the unmasked tokens. Label smoothing eps needs the sum of the logits over the *whole*
vocabulary (PyTorch: (1-eps) nll + eps * mean_v(-log p_v)); it travels with the target-logit SUM
as one [2, B, T] all-reduce, so still 3 all-reduces, 4 [B, T]-units of bytes.

What each rank receives: for the embedding, the dense table the harness hands `from_dense` with only rows
vocab_range(V, r, t) (the other ranks' rows NaN), and the replicated (B, T) ids and upstream grad dY (the
output is all-reduced, so every rank holds all of it); for the cross-entropy, only its own padded slice
(B, T, ceil(V/t)) of the logits, as a vocab-parallel lm_head leaves them, and the replicated targets. The
full logits and table stay in the trusted process: no rank can compute the loss or an id's row without the
all-reduces.

atol=1e-3: logits are 2 N(0, 1) in float32, a loss is a mean of O(1) terms, and the backward is seeded
with dL/dloss = B*T so each logit grad is O(1) (not O(1/#tokens), where an error would hide under the
atol); a correct implementation is within ~1e-6, a wrong mask or smoothing term is off by >1e-2.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. the embedding keeps rows vocab_range(V, r, t) in self.weight -> embedding*: `dW`; Contract.params (note)
 2. ... with zeros in the rows past V -> embedding_uneven (V=30, t=4): `weight shard kept by this rank`
    (new; fixture embedding_padding_ones)
 3. forward: mask, shift, look up, zero the masked rows, one all-reduce -> `y`, counts forward {all_reduce: 1},
    bytes_sent (fixture embedding_forgot_mask)
 4. its backward is the identity: no communication -> counts backward {}, `dW`
 5. cross-entropy: exactly 3 all-reduces of [B, T] forward, 3 * 2(t-1)/t * B*T*4 bytes -> cross_entropy*:
    Contract.counts, bytes_sent
 6. the first is a MAX all-reduce of the row max -> `forward all-reduces with ReduceOp.MAX` (new: read from the
    switchboard's record of each all-reduce's op; fixture row_max_summed)
 7. SUM of the target logit (owner only) and SUM of sum(exp) -> `loss`, `dlogits`
 8. padded columns are masked (the checker fills them with PAD_LOGIT) -> cross_entropy_uneven (V=30): `loss`
    (fixture padding_wins)
 9. the mean runs over a loss mask; ignore_index may be a real id -> cross_entropy_uneven,
    cross_entropy_ignore_real_id: `loss`, `dlogits` (fixture ignored_in_mean)
10. backward is local, no collective -> counts backward {} (fixture grad_allreduced)
11. vocab_size is the real V -> the V=30 and V=22 cases on t=4 hold padding columns
12. never gather the logits: no all-gather anywhere -> Contract.counts (fixture gathered_logits)
13. label smoothing averages over the whole real V, stacked with the target logit: still 3 all-reduces, 4 [B, T]
    units of bytes -> cross_entropy_smoothing: counts, bytes_sent, `loss` (fixture smoothing_local_vocab)
14. smoothing adds -eps/V on every real column in backward -> cross_entropy_smoothing: `dlogits`
15. 2, 3 and 4 ranks, V not divisible by t -> visible t = 2, 4 with V = 30, 22; hidden t = 3 with V = 37, 53
15 rules stated; 13 checked before this issue (2 and 6 were not), 15 checked now (rule 1 by `dW`; Contract.params a
note).
Course-wide rule (not in this lab's text): code may not write into the tensors it is given -> every case,
note (inside the rank, not scored): ctx.hand on the dense table, the ids, the logits and the targets (fixture
targets_overwritten: full marks, with the note).
Course-wide rule: a rank holds only what its rank owns -> `_own_rows`, `_own_logits` (fixture
dense_table_lookup).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.judge.case import Case, Contract, register
from grader.rank.week04 import WEIGHT_SHARD, upstream
from reference import backward

MODULE = "vocab_parallel"
PAD_LOGIT = 30.0   # what a padded lm_head row might produce: must never win


def padded_rows(vocab: int, t: int) -> int:
    return math.ceil(vocab / t)


def pad_shard(x: torch.Tensor, vocab: int, r: int, t: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """Rank r's slice of x padded along `dim` from V to t ceil(V/t) entries."""
    per = padded_rows(vocab, t)
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, t * per - vocab]
    return F.pad(x, pad, value=value).narrow(dim, r * per, per).contiguous()


# -- embedding -------------------------------------------------------------------
def _emb_inputs(cfg, gen):
    B, T, V, C = cfg["batch"], cfg["seq"], cfg["vocab"], cfg["hidden"]
    ids = torch.randint(0, V, (B, T), generator=gen)
    ids[0, 0], ids[-1, -1] = 0, V - 1                       # the first and the last row, always
    return {"ids": ids, "W": torch.randn(V, C, generator=gen), "dy": torch.randn(B, T, C, generator=gen)}


def _own_rows(cfg, inp, r, t):
    """The dense table with only rank r's rows [r ceil(V/t), (r+1) ceil(V/t)) of the real V; ids and dY whole."""
    V, per = cfg["vocab"], padded_rows(cfg["vocab"], t)
    lo, hi = min(r * per, V), min((r + 1) * per, V)         # a rank past V holds padding only: no real row
    w = torch.full_like(inp["W"], float("nan"))
    w[lo:hi] = inp["W"][lo:hi]
    return {"ids": inp["ids"], "W": w, "dy": inp["dy"]}


def _emb_reference(cfg, inp):
    w = inp["W"].clone().requires_grad_(True)
    y = F.embedding(inp["ids"], w)                          # (B, T, C)
    backward(y, inp["dy"])
    return {"y": y.detach(), "dW": w.grad, "W": inp["W"]}


def _emb_expected(cfg, ref, r, t):
    return {"y": ref["y"], "dW": pad_shard(ref["dW"], cfg["vocab"], r, t, 0),
            WEIGHT_SHARD: pad_shard(ref["W"], cfg["vocab"], r, t, 0)}    # its rows of the table, zeros past V


def _emb_contract(cfg, t):
    return Contract(
        counts={"forward": {"all_reduce": 1}, "backward": {}},
        bytes_sent={"forward": 2 * (t - 1) / t * cfg["batch"] * cfg["seq"] * cfg["hidden"] * 4},
        params={"weight": (padded_rows(cfg["vocab"], t), cfg["hidden"])},
        why={"forward": "each rank looks up the ids it owns and zeros the rest: one all-reduce of (B, T, C) sums them.",
             "backward": "the all-reduce's backward is the identity; each rank scatters dY into its own rows."})


# -- cross-entropy ----------------------------------------------------------------
def _ce_inputs(cfg, gen):
    B, T, V = cfg["batch"], cfg["seq"], cfg["vocab"]
    targets = torch.randint(0, V, (B, T), generator=gen)
    drop = torch.rand(B, T, generator=gen) < cfg.get("ignore_frac", 0.0)
    targets[drop] = cfg["ignore_index"]
    targets[0, 0] = (cfg["ignore_index"] + 1) % V if 0 <= cfg["ignore_index"] < V else V - 1  # one kept token
    return {"logits": 2.0 * torch.randn(B, T, V, generator=gen), "targets": targets}


def _own_logits(cfg, inp, r, t):
    """Rank r's padded vocab slice of the logits, its padded columns PAD_LOGIT (garbage a padded lm_head row could
    produce: it must never win); the targets whole."""
    return {"logits": pad_shard(inp["logits"], cfg["vocab"], r, t, -1, value=PAD_LOGIT),   # (B, T, ceil(V/t))
            "targets": inp["targets"]}


def _ce_reference(cfg, inp):
    z = inp["logits"].clone().requires_grad_(True)
    loss = F.cross_entropy(z.flatten(0, 1), inp["targets"].flatten(), ignore_index=cfg["ignore_index"],
                           label_smoothing=cfg["smoothing"])          # mean over the kept tokens
    backward(loss, torch.tensor(upstream(cfg)))
    return {"loss": loss.detach(), "dlogits": z.grad}


def _ce_expected(cfg, ref, r, t):
    return {"loss": ref["loss"], "dlogits": pad_shard(ref["dlogits"], cfg["vocab"], r, t, -1),
            MAX_REDUCES: torch.tensor([1])}


MAX_REDUCES = "forward all-reduces with ReduceOp.MAX"


def _max_reduces(cfg, record: list, r: int, t: int) -> dict:
    """The forward all-reduces whose op is MAX, from the record of the rank's collectives."""
    n = sum(e.get("op") == "all_reduce" and e.get("reduce") == "max" and e.get("phase") == "forward" for e in record)
    return {MAX_REDUCES: torch.tensor([n])}


def _ce_contract(cfg, t):
    units = 4 if cfg["smoothing"] > 0 else 3
    return Contract(
        counts={"forward": {"all_reduce": 3}, "backward": {}},
        bytes_sent={"forward": units * 2 * (t - 1) / t * cfg["batch"] * cfg["seq"] * 4},
        why={"forward": "three all-reduces of [B, T] only: MAX of the row max, SUM of the target logit (with label "
                        "smoothing: stacked with the sum of the logits), SUM of the sum of exp. Never gather the "
                        "[B, T, V] logits.",
             "backward": "softmax - onehot is local: each rank already holds its softmax columns and the global "
                         "sum-exp, so the backward needs no collective."})


HINTS = {
    "y": "Mask the ids outside [vocab_start, vocab_end), shift the rest, look up, zero the masked rows, then "
         "all-reduce once.",
    "dW": "Rank r's weight grad is rows [r ceil(V/t), (r+1) ceil(V/t)) of the dense grad, zero on padding rows.",
    "loss": "The mean runs over the kept tokens only (targets != ignore_index, a loss mask); padded columns "
            "(global id >= vocab_size) must be masked out before the max and the sum of exp; label smoothing "
            "averages -log p over the whole vocabulary (vocab_size), not over the local shard.",
    "dlogits": "Backward is (softmax - (1-eps) onehot - eps/V) * mask / #kept on your columns, zero on padded "
               "columns and on ignored tokens.",
    WEIGHT_SHARD: "Rank r keeps rows vocab_range(V, r, t) of the dense weight in self.weight, and zeros in the rows "
                  "past V (padding ids no one looks up).",
    MAX_REDUCES: "Step 1 all-reduces the row max with op=dist.ReduceOp.MAX, once: a SUM of the local maxima is not "
                 "the global max: the shift is too large, and for large logits every exp(z - m) underflows to 0.",
}


def _c(**kw):
    d = {"batch": 2, "seq": 6, "vocab": 64, "hidden": 16, "ignore_index": -100, "smoothing": 0.0, "ignore_frac": 0.0}
    d.update(kw)
    return d


EMB = [("embedding", (2, 4), _c(), 0), ("embedding_uneven", (2, 4), _c(vocab=30), 1),
       ("embedding_hidden", (3, 4), _c(batch=3, seq=4, vocab=37, hidden=12), None)]
CE = [("cross_entropy", (2, 4), _c(), 2),
      ("cross_entropy_uneven", (2, 4), _c(vocab=30, ignore_frac=0.3), 3),
      ("cross_entropy_smoothing", (2, 4), _c(vocab=30, ignore_frac=0.3, smoothing=0.1), 4),
      ("cross_entropy_hidden", (3, 4), _c(batch=3, seq=5, vocab=37, ignore_frac=0.2), None),
      ("cross_entropy_ignore_real_id", (2, 4), _c(seq=6, vocab=22, ignore_index=5, ignore_frac=0.25), 5),
      ("cross_entropy_ignore_real_id_hidden", (2, 4), _c(seq=7, vocab=21, ignore_index=3, ignore_frac=0.2), None),
      ("cross_entropy_smoothing_hidden", (3, 4), _c(batch=1, seq=9, vocab=53, ignore_frac=0.2, smoothing=0.2), None)]

for name, ws, cfg, seed in EMB:
    register(Case(name=f"week04/{name}", module=MODULE, world_sizes=ws, config=cfg, make_inputs=_emb_inputs,
                  reference=_emb_reference, run_rank="run_embedding", expected=_emb_expected, contract=_emb_contract,
                  seed=seed, hidden=seed is None, rank_inputs=_own_rows, title="VocabParallelEmbedding",
                  hints=HINTS))
for name, ws, cfg, seed in CE:
    register(Case(name=f"week04/{name}", module=MODULE, world_sizes=ws, config=cfg, make_inputs=_ce_inputs,
                  reference=_ce_reference, run_rank="run_cross_entropy", expected=_ce_expected, contract=_ce_contract,
                  from_record=_max_reduces,
                  seed=seed, hidden=seed is None, rank_inputs=_own_logits, title="vocab-parallel cross-entropy",
                  hints=HINTS))
