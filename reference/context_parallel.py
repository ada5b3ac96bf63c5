"""Context parallelism: attention over a sequence split across t ranks, three ways.

Tensors are (B, nh, T, hs); the sequence is dim 2. Causal attention, softmax scale 1/sqrt(hs). Here t is the
CP degree (the Week 10 lecture writes it c and keeps t for the TP degree).

- Ring attention (Liu et al. 2023, arXiv 2310.01889): each rank keeps its queries; K/V blocks travel
  around the ring, and each rank merges the partial results with the log-sum-exp rule (Milakov and
  Gimelshein 2018): for two key sets with partial outputs o_1, o_2 and row log-sum-exps l_1, l_2,
      l = log(e^{l_1} + e^{l_2}),   o = e^{l_1 - l} o_1 + e^{l_2 - l} o_2          (exact).
  Backward: K/V travel again, and the accumulated dK/dV of each block travel with them, one more step
  at the end, back to the block's owner.
- Causal load balance (Megatron-LM's CP, torchtitan's context_parallel): cut T into 2t chunks; rank r
  holds chunks r and 2t-1-r, so every rank has as many early (cheap) as late (expensive) queries.
- DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509): an all-to-all turns sequence shards into
  head shards (B, nh/t, T, hs), plain attention runs per head group, an all-to-all turns it back. This
  version requires t | nh (by choice: DeepSpeed's DistributedAttention splits heads unevenly with
  `uneven_heads_all2all`, and its ALST Ulysses replicates K/V heads when t > n_kv, `kv_replication_factor`).
- All-gather K/V (Dubey et al. 2024, arXiv 2407.21783, Sec. 3.3.2, Llama 3; the paper describes the
  forward only): all-gather K and V, attend the local (load-balanced) queries to them; backward
  reduce-scatters dK/dV. Here autograd keeps the gathered K/V for backward (simple, but the whole K/V per
  layer); TransformerEngine's AttnFuncWithCPAndKVAllGather instead saves only the local K/V, all-gathers
  them again in backward and then reduce-scatters dK/dV.
- Packed documents (TransformerEngine's THD format, Megatron-LM's per-document balancing): several documents
  of lengths L_d packed into one sequence, described by cu_seqlens = [0, L_0, L_0 + L_1, ...]. Query i sees
  key j iff both are in the same document and j <= i (a block-diagonal causal mask). Each document, not the
  whole sequence, is cut into 2t chunks and rank r keeps chunks r and 2t-1-r of every document
  (TE's thd_partition_indices_kernel), so every rank holds 1/t of every document's causal triangle.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


# -- layout ---------------------------------------------------------------------------------------
def chunk_ids(r: int, t: int, balanced: bool = True) -> tuple[int, int]:
    """The two of 2t sequence chunks rank r holds: mirrored (r, 2t-1-r), or contiguous (2r, 2r+1)."""
    return (r, 2 * t - 1 - r) if balanced else (2 * r, 2 * r + 1)


def shard_seq(x: torch.Tensor, r: int, t: int, balanced: bool = True) -> torch.Tensor:
    """Rank r's two chunks of x along T, concatenated: (B, nh, T, hs) -> (B, nh, T/t, hs)."""
    ch = x.chunk(2 * t, dim=2)
    return torch.cat([ch[i] for i in chunk_ids(r, t, balanced)], dim=2)


def positions(T: int, r: int, t: int, balanced: bool = True) -> torch.Tensor:
    return shard_seq(torch.arange(T).view(1, 1, T, 1), r, t, balanced).flatten()


# -- dense attention and one block of it ---------------------------------------------------------
def causal_attention(q, k, v):
    """Dense causal attention, the single-device reference: softmax(q k^T / sqrt(hs) + mask) v."""
    T = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])             # (B, nh, T, T)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _scores(q, k, diag, allowed=None):
    """allowed: a (Tq, Tk) bool mask of the pairs that may attend (packed documents); diag: causal inside."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])             # (B, nh, Tq, Tk)
    if diag:           # a chunk against itself: causal inside it
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _finite(lse):
    """lse with -inf (a row that sees no key of this block) lifted to the lowest float, so that
    exp(s - lse) and exp(lse - new) give 0 there instead of exp(-inf + inf) = NaN."""
    return lse.clamp(min=torch.finfo(lse.dtype).min)


def block_forward(q, k, v, diag, allowed=None):
    """Attention of q to one block of keys: (o, lse), o = softmax(s) v over this block, lse = logsumexp(s).
    A row with no allowed key in the block gets o = 0, lse = -inf: it adds nothing when merged."""
    s = _scores(q, k, diag, allowed)
    lse = torch.logsumexp(s, dim=-1)                                  # (B, nh, Tq)
    return torch.exp(s - _finite(lse).unsqueeze(-1)) @ v, lse


def block_backward(q, k, v, o, lse, do, diag, allowed=None):
    """Grads of one block given the FINAL o and lse of the rows: P = exp(s - lse) is the block's slice of
    the full softmax, so dV = P^T dO, dS = P (dO V^T - rowsum(dO o)), dQ = dS K / sqrt(hs), dK = dS^T Q / sqrt(hs)."""
    scale = 1 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, diag, allowed) - lse.unsqueeze(-1))  # (B, nh, Tq, Tk); masked pairs: 0
    ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


def merge(o, lse, o_b, lse_b):
    """Online-softmax merge of two partial results over disjoint key sets (exact)."""
    new = torch.logaddexp(lse, lse_b)
    ref = _finite(new)                                                # rows empty in both stay o = 0, lse = -inf
    return o * torch.exp(lse - ref).unsqueeze(-1) + o_b * torch.exp(lse_b - ref).unsqueeze(-1), new


def block_pairs(r: int, src: int, t: int, balanced: bool = True):
    """(i, j, diag) for each (query chunk i of rank r, key chunk j of rank src) with an unmasked score:
    chunk j before chunk i -> full block; the same chunk -> causal block; after -> skipped."""
    qi, kj = chunk_ids(r, t, balanced), chunk_ids(src, t, balanced)
    return [(a, b, qi[a] == kj[b]) for a in range(2) for b in range(2) if kj[b] <= qi[a]]


# -- ring attention ------------------------------------------------------------------------------
def ring_pass_start(x, group=None):
    """Post one ring step: send x to the next rank, receive the previous rank's x. Returns (buffer, works)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % t),
                                    dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - 1) % t)])
    return recv, works


def ring_pass(x, group=None):
    recv, works = ring_pass_start(x, group)
    for w in works:
        w.wait()
    return recv


class RingAttention(torch.autograd.Function):
    """q, k, v: this rank's two chunks (B, nh, T/t, hs) -> its two chunks of causal attention output.

    Step s holds the K/V of rank (r - s) mod t; the next block is posted before this one is computed, so
    the ring hides its transfers under the block GEMMs (t-1 passes of the stacked K/V forward).
    """

    @staticmethod
    def forward(ctx, q, k, v, group=None, balanced=True):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        qc = q.chunk(2, dim=2)
        o, lse = [None, None], [None, None]
        kv = torch.stack([k, v])                                      # (2, B, nh, T/t, hs): one message per step
        for s in range(t):
            if s < t - 1:
                nxt, works = ring_pass_start(kv, group)
            kc, vc = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for a, b, diag in block_pairs(r, (r - s) % t, t, balanced):
                ob, lb = block_forward(qc[a], kc[b], vc[b], diag)
                o[a], lse[a] = (ob, lb) if o[a] is None else merge(o[a], lse[a], ob, lb)
            if s < t - 1:
                for w in works:
                    w.wait()
                kv = nxt
        out, lse = torch.cat(o, dim=2), torch.cat(lse, dim=2)          # (B, nh, T/t, hs), (B, nh, T/t)
        ctx.save_for_backward(q, k, v, out, lse)                       # only local tensors: no K/V of other ranks
        ctx.group, ctx.balanced = group, balanced
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, t, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        qc, oc, lc, doc = q.chunk(2, 2), out.chunk(2, 2), lse.chunk(2, 2), do.contiguous().chunk(2, 2)
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype)
        for s in range(t):
            if s < t - 1:
                nxt, works = ring_pass_start(kv, group)
            kc, vc = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            dkc, dvc = dkv[0].chunk(2, 2), dkv[1].chunk(2, 2)          # views: += writes into dkv
            for a, b, diag in block_pairs(r, (r - s) % t, t, ctx.balanced):
                dqa, dkb, dvb = block_backward(qc[a], kc[b], vc[b], oc[a], lc[a], doc[a], diag)
                dq.chunk(2, 2)[a].add_(dqa)
                dkc[b].add_(dkb)
                dvc[b].add_(dvb)
            # the block's dK/dV are partial sums over the queries seen so far: they travel on with the K/V,
            # and the last pass (s = t-1) hands them to their owner, rank r+1
            dkv = ring_pass(dkv, group)
            if s < t - 1:
                for w in works:
                    w.wait()
                kv = nxt
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q, k, v, group=None, balanced=True):
    return RingAttention.apply(q, k, v, group, balanced)


# -- DeepSpeed-Ulysses ---------------------------------------------------------------------------
def seq_to_heads(x, group=None):
    """(B, nh, T/t, hs) sequence shard -> (B, nh/t, T, hs) head shard, with one all-to-all."""
    t = dist.get_world_size(group)
    B, nh, Tl, hs = x.shape
    xs = x.reshape(B, t, nh // t, Tl, hs).transpose(0, 1).contiguous()    # (t, B, nh/t, T/t, hs): part j -> rank j
    out = torch.empty_like(xs)
    dist.all_to_all_single(out, xs, group=group)                          # out[j]: rank j's positions, my heads
    return out.permute(1, 2, 0, 3, 4).reshape(B, nh // t, t * Tl, hs)    # (B, nh/t, T, hs)


def heads_to_seq(x, group=None):
    """(B, nh/t, T, hs) head shard -> (B, nh, T/t, hs) sequence shard: the inverse all-to-all."""
    t = dist.get_world_size(group)
    B, hl, T, hs = x.shape
    xs = x.reshape(B, hl, t, T // t, hs).permute(2, 0, 1, 3, 4).contiguous()   # (t, B, nh/t, T/t, hs)
    out = torch.empty_like(xs)
    dist.all_to_all_single(out, xs, group=group)                          # out[j]: rank j's heads, my positions
    return out.transpose(0, 1).reshape(B, t * hl, T // t, hs)             # (B, nh, T/t, hs)


class SeqToHeads(torch.autograd.Function):
    """The adjoint of a permutation is its inverse: backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g.contiguous(), ctx.group), None


def ulysses_attention(q, k, v, group=None):
    """q, k, v: contiguous sequence shards (B, nh, T/t, hs) -> this rank's shard of the output.
    4 all-to-alls forward (q, k, v in, output out), 4 backward."""
    t, nh = dist.get_world_size(group), q.shape[1]
    if nh % t:
        raise ValueError(f"This Ulysses needs the number of heads divisible by the CP degree: {nh} heads on {t} "
                         f"ranks (a choice of this course: DeepSpeed splits heads unevenly instead). Use a degree "
                         f"that divides {nh}, or ring attention (no such limit).")
    o = causal_attention(*(SeqToHeads.apply(x, group) for x in (q, k, v)))   # (B, nh/t, T, hs)
    return HeadsToSeq.apply(o, group)


# -- all-gather K/V (Llama 3) --------------------------------------------------------------------
class GatherKV(torch.autograd.Function):
    """(2, B, nh, T/t, hs) stacked local K/V -> (t, 2, B, nh, T/t, hs): every rank's. Backward:
    reduce-scatter, because every rank's queries contributed to the grad of every K/V block. The attention
    that consumes the gathered K/V saves it for backward (this module's choice, not the method's: see the
    module docstring for TransformerEngine's re-gather)."""

    @staticmethod
    def forward(ctx, kv, group=None):
        ctx.group = group
        t = dist.get_world_size(group)
        out = kv.new_empty((t * kv.shape[0],) + tuple(kv.shape[1:]))       # the collectives split dim 0
        dist.all_gather_single(out, kv.contiguous(), group=group)
        return out.view(t, *kv.shape)

    @staticmethod
    def backward(ctx, g):
        out = torch.empty_like(g[0])
        dist.reduce_scatter_single(out, g.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def allgather_kv_attention(q, k, v, group=None, cu_seqlens=None):
    """Load-balanced local q (B, nh, T/t, hs) against the gathered K/V of all T positions. With cu_seqlens
    (packed documents, each cut per document) the mask is block-diagonal causal; without, one document."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    cu = torch.tensor([0, q.shape[2] * t]) if cu_seqlens is None else cu_seqlens
    kv = GatherKV.apply(torch.stack([k, v]), group)                      # (t, 2, B, nh, T/t, hs)
    kf, vf = (kv[:, i].permute(1, 2, 0, 3, 4).flatten(2, 3) for i in range(2))   # (B, nh, T, hs), rank order
    kpos = torch.cat([doc_positions(cu, j, t) for j in range(t)])
    s = _scores(q, kf, False, document_mask(doc_positions(cu, r, t), kpos, cu))  # (B, nh, T/t, T)
    return torch.softmax(s, dim=-1) @ vf


# -- packed documents ------------------------------------------------------------------------------
def doc_ids(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The document of each (global) position: the d with cu_seqlens[d] <= pos < cu_seqlens[d+1]."""
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def document_mask(qpos, kpos, cu_seqlens):
    """(Tq, Tk) bool: query position i may see key position j iff same document and j <= i."""
    same = doc_ids(qpos, cu_seqlens)[:, None] == doc_ids(kpos, cu_seqlens)[None, :]
    return same & (kpos[None, :] <= qpos[:, None])


def document_causal_attention(q, k, v, cu_seqlens):
    """Dense attention with the block-diagonal causal mask of packed documents: the single-device reference."""
    pos = torch.arange(q.shape[2])
    return torch.softmax(_scores(q, k, False, document_mask(pos, pos, cu_seqlens)), dim=-1) @ v


def doc_positions(cu_seqlens, r: int, t: int, per_document: bool = True) -> torch.Tensor:
    """The global positions rank r holds, in its local order. per_document: every document cut into 2t chunks,
    chunks r and 2t-1-r of each, document after document (TE's THD layout; each length divisible by 2t);
    otherwise the whole packed sequence cut into 2t chunks (the §5 layout, blind to documents)."""
    if not per_document:
        return positions(int(cu_seqlens[-1]), r, t)
    starts, lens = cu_seqlens[:-1].tolist(), cu_seqlens.diff().tolist()
    if any(n % (2 * t) for n in lens):
        raise ValueError(f"per-document balancing needs every document length divisible by 2t = {2 * t}: {lens} "
                         f"(TransformerEngine pads each document, pad_thd_sequences_for_cp)")
    return torch.cat([a + positions(n, r, t) for a, n in zip(starts, lens)])


def shard_docs(x, cu_seqlens, r: int, t: int, per_document: bool = True):
    """Rank r's tokens of x (B, nh, T, hs) -> (B, nh, T/t, hs), in doc_positions order."""
    return x[:, :, doc_positions(cu_seqlens, r, t, per_document)]


def step_mask(cu_seqlens, r: int, src: int, t: int, per_document: bool = True):
    """(T/t, T/t) bool: which of rank r's queries see which of rank src's keys. Inside one document this is
    §5's pair rule (an earlier chunk in full, the same chunk causal, a later one not at all); across
    documents nothing: what TE's varlen kernel gets from cu_seqlens/(2t) at each ring step."""
    return document_mask(doc_positions(cu_seqlens, r, t, per_document),
                         doc_positions(cu_seqlens, src, t, per_document), cu_seqlens)


def pair_counts(cu_seqlens, t: int, per_document: bool = True) -> torch.Tensor:
    """(t, t): unmasked (query, key) pairs of rank r at ring step s (the K/V of rank (r - s) mod t): the work of a
    fused varlen kernel, which skips masked pairs (up to its tile size)."""
    return torch.tensor([[int(step_mask(cu_seqlens, r, (r - s) % t, t, per_document).sum()) for s in range(t)]
                         for r in range(t)])


class DocRingAttention(torch.autograd.Function):
    """Ring attention over packed documents: q, k, v (B, nh, T/t, hs) are rank r's tokens (shard_docs);
    cu_seqlens (every rank has it, as TE's does) says where documents start. The ring and its bytes are
    RingAttention's; each step attends the local queries to the K/V it holds under step_mask, and skips
    the GEMMs when that mask is empty."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, group=None, per_document=True):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        o = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)  # (B, nh, T/t): no key seen yet
        kv = torch.stack([k, v])                                      # (2, B, nh, T/t, hs)
        for s in range(t):
            if s < t - 1:
                nxt, works = ring_pass_start(kv, group)
            allowed = step_mask(cu_seqlens, r, (r - s) % t, t, per_document)
            if allowed.any():
                o, lse = merge(o, lse, *block_forward(q, kv[0], kv[1], False, allowed))
            if s < t - 1:
                for w in works:
                    w.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.group, ctx.per_document = group, per_document
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        group, t, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype)
        for s in range(t):
            if s < t - 1:
                nxt, works = ring_pass_start(kv, group)
            allowed = step_mask(cu_seqlens, r, (r - s) % t, t, ctx.per_document)
            if allowed.any():
                dqs, dks, dvs = block_backward(q, kv[0], kv[1], o, lse, do.contiguous(), False, allowed)
                dq += dqs
                dkv += torch.stack([dks, dvs])
            dkv = ring_pass(dkv, group)                               # with the K/V; the last pass: home
            if s < t - 1:
                for w in works:
                    w.wait()
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None


def doc_ring_attention(q, k, v, cu_seqlens, group=None, per_document=True):
    return DocRingAttention.apply(q, k, v, cu_seqlens, group, per_document)
