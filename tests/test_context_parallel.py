"""reference/context_parallel.py against dense causal attention, forward and backward, on 2 and 4 ranks
(ring attention in both layouts, Ulysses, all-gather K/V), with their collectives counted; and the
single-process pieces: the log-sum-exp merge, the layout, the causal work per rank."""
import textwrap

import pytest
import torch

from launch import run
from reference import context_parallel as cp

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from launch.dist import init_process_group
    from reference import context_parallel as cp
    from tpkit.ledger import CommLedger
    rank, t, _ = init_process_group()
    g = torch.Generator().manual_seed(0)
    B, nh, T, hs = 2, 4, 24, 8
    q, k, v, dy = (torch.randn(B, nh, T, hs, generator=g) for _ in range(4))
    qd, kd, vd = (x.clone().requires_grad_(True) for x in (q, k, v))
    cp.causal_attention(qd, kd, vd).backward(dy)
    dense = {"y": None, "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
    dense["y"] = cp.causal_attention(q, k, v)
    kv = 2 * B * nh * (T // t) * hs * 4                    # one stacked local K/V, bytes
    for name, fn, balanced, fwd, bwd in [
            ("ring", cp.ring_attention, True, {"send": t - 1, "recv": t - 1}, {"send": 2 * t - 1, "recv": 2 * t - 1}),
            ("ring_contiguous", lambda *a: cp.ring_attention(*a, None, False), False,
             {"send": t - 1, "recv": t - 1}, {"send": 2 * t - 1, "recv": 2 * t - 1}),
            ("ulysses", cp.ulysses_attention, False, {"all_to_all": 4}, {"all_to_all": 4}),
            ("allgather_kv", cp.allgather_kv_attention, True, {"all_gather": 1}, {"reduce_scatter": 1})]:
        # Ulysses takes contiguous shards: rank r's chunks 2r, 2r+1 of 2t are positions r*T/t:(r+1)*T/t
        loc = [cp.shard_seq(x, rank, t, balanced).requires_grad_(True) for x in (q, k, v)]
        with CommLedger(t) as L:
            L.set_phase("forward")
            y = fn(*loc)
            L.set_phase("backward")
            y.backward(cp.shard_seq(dy, rank, t, balanced))
        got = {"y": y, "dq": loc[0].grad, "dk": loc[1].grad, "dv": loc[2].grad}
        for key, want in dense.items():
            err = (got[key] - cp.shard_seq(want, rank, t, balanced)).abs().max().item()
            assert err < 1e-5, (name, key, err)
        assert L.counts("forward") == fwd and L.counts("backward") == bwd, (name, L.counts())
        if name.startswith("ring"):
            assert L.bytes_sent("forward") == (t - 1) * kv and L.bytes_sent("backward") == (2 * t - 1) * kv
        else:   # Ulysses: 4 all-to-alls of a local (B, nh, T/t, hs), (t-1)/t of each leaves; all-gather: (t-1) K/V blocks
            want = {"ulysses": 2 * (t - 1) / t * kv, "allgather_kv": (t - 1) * kv}[name]
            assert abs(L.bytes_sent("forward") - want) < 1e-6 and abs(L.bytes_sent("backward") - want) < 1e-6
    try:
        cp.ulysses_attention(*(torch.zeros(1, t + 1, 2 * t, 8) for _ in range(3)))
        raise AssertionError("no error for heads not divisible by t")
    except ValueError as e:
        assert "divisible" in str(e)
    print("ok", t)
""")


def _every_rank_ok(tmp_path, script: str, t: int):
    path = tmp_path / "cp.py"
    path.write_text(script)
    res = run(str(path), t, module=False, backend="gloo", timeout=120)
    assert res.returncode == 0, res.output
    assert res.output.count(f"ok {t}") == t


@pytest.mark.parametrize("t", [2, 4])
def test_variants_match_dense_attention(tmp_path, t):
    _every_rank_ok(tmp_path, SCRIPT, t)


def test_merge_of_key_blocks_is_dense_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    o, lse = cp.block_forward(q, k[:, :, :5], v[:, :, :5], False)
    for lo, hi in ((5, 9), (9, 12)):
        o, lse = cp.merge(o, lse, *cp.block_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], False))
    s = q @ k.transpose(-2, -1) / 8 ** 0.5
    assert torch.allclose(o, torch.softmax(s, -1) @ v, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)


def test_layout_covers_every_position_once():
    for t in (2, 3, 5):
        for balanced in (True, False):
            pos = torch.cat([cp.positions(10 * t, r, t, balanced) for r in range(t)])
            assert sorted(pos.tolist()) == list(range(10 * t))
    assert cp.positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp.positions(8, 1, 2, balanced=False).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("t", [2, 3, 4, 8])
def test_load_balance_equalises_causal_work(t):
    """c x c score blocks per rank (a causal diagonal block counts 1/2): mirrored chunks give every rank 2t;
    contiguous chunks 2r, 2r+1 give rank r 4r + 2 (the same 2t^2 in all, the last rank twice the mean)."""
    def work(r, balanced):
        return sum(0.5 if diag else 1.0 for s in range(t) for _, _, diag in cp.block_pairs(r, s, t, balanced))
    assert [work(r, True) for r in range(t)] == [2.0 * t] * t
    assert [work(r, False) for r in range(t)] == [4.0 * r + 2 for r in range(t)]


DOC_SCRIPT = textwrap.dedent("""
    import torch
    from launch.dist import init_process_group
    from reference import context_parallel as cp
    from tpkit.ledger import CommLedger
    rank, t, _ = init_process_group()
    g = torch.Generator().manual_seed(0)
    B, nh, T, hs = 2, 2, 16 * t, 8
    cu = torch.tensor([0, 4 * t, 6 * t, 16 * t])             # three documents of 4t, 2t, 10t tokens
    q, k, v, dy = (torch.randn(B, nh, T, hs, generator=g) for _ in range(4))
    qd, kd, vd = (x.clone().requires_grad_(True) for x in (q, k, v))
    y = cp.document_causal_attention(qd, kd, vd, cu)
    y.backward(dy)
    dense = {"y": y.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
    kv = 2 * B * nh * (T // t) * hs * 4
    for name, fn, per_doc, fwd, bwd in [
            ("ring", lambda *a: cp.doc_ring_attention(*a, cu), True, (t - 1) * kv, (2 * t - 1) * kv),
            ("ring_whole_sequence", lambda *a: cp.doc_ring_attention(*a, cu, None, False), False,
             (t - 1) * kv, (2 * t - 1) * kv),
            ("allgather_kv", lambda *a: cp.allgather_kv_attention(*a, None, cu), True, (t - 1) * kv, (t - 1) * kv)]:
        loc = [cp.shard_docs(x, cu, rank, t, per_doc).requires_grad_(True) for x in (q, k, v)]
        with CommLedger(t) as L:
            L.set_phase("forward")
            out = fn(*loc)
            L.set_phase("backward")
            out.backward(cp.shard_docs(dy, cu, rank, t, per_doc))
        got = {"y": out, "dq": loc[0].grad, "dk": loc[1].grad, "dv": loc[2].grad}
        for key, want in dense.items():
            err = (got[key] - cp.shard_docs(want, cu, rank, t, per_doc)).abs().max().item()
            assert err < 1e-5, (name, key, err)
        assert L.bytes_sent("forward") == fwd and L.bytes_sent("backward") == bwd, (name, L.bytes_sent("forward"))
    print("ok", t)
""")


@pytest.mark.parametrize("t", [2, 4])
def test_packed_documents_match_block_diagonal_attention(tmp_path, t):
    """Ring (per-document and whole-sequence chunks) and all-gather K/V with the document mask: exact against
    dense attention with the block-diagonal causal mask, forward and backward, the ring's bytes unchanged."""
    _every_rank_ok(tmp_path, DOC_SCRIPT, t)


def test_document_layout_and_mask():
    cu = torch.tensor([0, 8, 12])
    assert cp.doc_positions(cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]      # chunks 0, 3 of each document
    assert cp.doc_positions(cu, 1, 2, per_document=False).tolist() == [3, 4, 5, 6, 7, 8]
    for t in (2, 3):
        cu = torch.tensor([0, 2 * t, 8 * t, 10 * t])
        for per_doc in (True, False):
            pos = torch.cat([cp.doc_positions(cu, r, t, per_doc) for r in range(t)])
            assert sorted(pos.tolist()) == list(range(10 * t))
    pos = torch.arange(12)
    m = cp.document_mask(pos, pos, torch.tensor([0, 8, 12]))
    assert m[9, 7].item() is False and m[9, 8].item() is True and m[7, 0].item() is True and m[3, 4].item() is False
    with pytest.raises(ValueError, match="divisible by 2t"):
        cp.doc_positions(torch.tensor([0, 6, 12]), 0, 2)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_per_document_chunks_balance_every_step(t):
    """Per-document chunks give every rank L(L+1)/(2t) pairs of each document L, at every ring step the same
    work on every rank; whole-sequence chunks of the same packing do not."""
    lens = [2 * t, 6 * t, 8 * t]                                            # 16t tokens
    cu = torch.tensor([0, 2 * t, 8 * t, 16 * t])
    per_doc, whole = cp.pair_counts(cu, t), cp.pair_counts(cu, t, per_document=False)
    assert per_doc.sum() == whole.sum() == sum(n * (n + 1) // 2 for n in lens)
    assert (per_doc.sum(1) == sum(n * (n + 1) // (2 * t) for n in lens)).all()
    assert (per_doc == per_doc[0]).all()                                    # every step equal across ranks
    assert whole.sum(1).max() > whole.sum(1).min()
