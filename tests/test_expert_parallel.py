"""reference.expert_parallel against dense single-device math: routing (pure, dropless, biased), the grouped GEMM,
then EP (with capacity and dropless), EP x ETP and the all-gather dispatcher on 4 ranks, forward and backward, with
every collective's count, split sizes and bytes checked against the ledger.

The multi-rank part is this file run as a script on 4 ranks (`python tests/test_expert_parallel.py`)."""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference.expert_parallel import (capacity, dense_moe, expert_bias_update, expert_ffn, grouped_ffn,  # noqa: E402
                                       route, route_biased, z_loss)

H, F, E, K, N, C = 8, 16, 8, 2, 12, 1.0


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g), torch.randn(E, F, H, generator=g) / 3, torch.randn(E, H, F, generator=g) / 4,
            torch.randn(4 * N, H, generator=g), torch.randn(4 * N, H, generator=g))


def test_capacity_is_the_ceiling():
    assert capacity(12, 2, 8, 1.0) == 3 and capacity(13, 2, 8, 1.0) == 4 and capacity(12, 2, 8, 1.25) == 4


def test_route_drops_in_token_order_and_renormalises():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(3)) * 3
    r = route(logits, 2, 1.0)
    cap = capacity(16, 2, 4, 1.0)
    assert torch.allclose(r.gates.sum(-1), torch.ones(16))
    for e in range(4):
        mask = r.experts == e                                           # (N, k): at most one True per token
        toks = mask.any(1).nonzero().squeeze(1)
        kept = (mask & r.keep).any(1)[toks]
        assert kept.tolist() == [i < cap for i in range(len(toks))]     # the first `cap` tokens, in order
    assert not r.keep.all()                                             # this seed overflows an expert
    f = torch.bincount(r.experts.flatten(), minlength=4).float() / 32
    assert torch.allclose(r.aux, 4 * (f * logits.softmax(-1).mean(0)).sum())


def test_uniform_router_has_aux_one():
    r = route(torch.zeros(8, 4), 2, 2.0)
    assert math.isclose(r.aux.item(), 1.0, rel_tol=1e-6)    # P_i = 1/E and sum f_i = 1, whatever the tie-break


def test_dropless_keeps_everything_capacity_does_not():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(3)) * 3
    assert route(logits, 2, None).keep.all() and not route(logits, 2, 1.0).keep.all()


def test_grouped_ffn_equals_the_loop_forward_and_backward():
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1])                                 # an empty expert included
    x, dy = torch.randn(9, H, generator=g), torch.randn(9, H, generator=g)
    w1, w2 = torch.randn(4, F, H, generator=g), torch.randn(4, H, F, generator=g)
    a = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
    b = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
    y = grouped_ffn(a[0], counts, a[1], a[2])
    want = torch.cat([expert_ffn(xb, w1_, w2_) for xb, w1_, w2_ in zip(b[0].split(counts.tolist()), b[1], b[2])])
    y.backward(dy); want.backward(dy)
    assert torch.allclose(y, want, atol=1e-5)
    assert all(torch.allclose(p.grad, q.grad, atol=1e-5) for p, q in zip(a, b))


def test_bias_steers_selection_not_gates():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 8, generator=g).requires_grad_(True)
    bias = torch.zeros(8); bias[0] = 5.0                                # every token now picks expert 0
    experts, gates = route_biased(logits, 2, bias)
    assert (experts == 0).any(1).all()
    s = logits.sigmoid().gather(1, experts)
    assert torch.allclose(gates, s / s.sum(-1, keepdim=True))           # the bias is not in the gates
    gates.sum().backward()                                              # the logits still get a gradient
    assert logits.grad is not None
    load = torch.bincount(experts.flatten(), minlength=8)
    assert expert_bias_update(bias, load, 0.1)[0] == 4.9 and expert_bias_update(bias, load, 0.1)[7] == 0.1


def test_z_loss_is_mean_squared_logsumexp():
    assert math.isclose(z_loss(torch.zeros(3, 4)).item(), math.log(4) ** 2, rel_tol=1e-6)


def test_dense_moe_matches_a_loop_over_tokens():
    wr, w1, w2, x, _ = _weights(0)
    y, _ = dense_moe(x, wr, w1, w2, K, C, 4)
    for g, xg in enumerate(x.chunk(4)):
        r = route(xg @ wr.T, K, C)
        for n in range(N):
            want = sum(r.gates[n, j] * torch.nn.functional.gelu(xg[n] @ w1[r.experts[n, j]].T) @ w2[r.experts[n, j]].T
                       for j in range(K) if r.keep[n, j])
            assert torch.allclose(y[g * N + n], torch.as_tensor(want) + 0 * y[0], atol=1e-5)


def test_graded_cases_drop_on_every_rank():
    """The lab's visible cases exercise the drop rule on every rank's tokens (hidden ones draw fresh seeds)."""
    from grader.judge.case import get_case
    for name in ("week11/routing", "week11/ep_layer"):
        case = get_case(name)
        d = case.make_inputs(case.config, torch.Generator().manual_seed(case.seed))
        for r in range(4):
            inp = case.rank_inputs(case.config, d, r, 4)
            logits = inp["logits"] if "logits" in inp else inp["x"] @ inp["router"].T
            assert not route(logits, case.config["k"], case.config["C"]).keep.all(), (name, r)


def test_graded_dropless_and_bias_cases_would_catch_their_mistakes():
    """ep_dropless's tokens overflow an expert at C = 1 and 1.25 on a rank of t = 2 (token blocks 0 and 1), so a
    'dropless' layer that still drops is caught at both sizes; route_biased's bias changes some token's selection on
    every rank (ignoring it is caught)."""
    from grader.judge.case import get_case
    case = get_case("week11/ep_dropless")
    d = case.make_inputs(case.config, torch.Generator().manual_seed(case.seed))
    for C in (1.0, 1.25):
        assert any(not route(d["x"][r * case.config["N"]:(r + 1) * case.config["N"]] @ d["router"].T,
                             case.config["k"], C).keep.all() for r in range(2)), C
    case = get_case("week11/route_biased")
    d = case.make_inputs(case.config, torch.Generator().manual_seed(case.seed))
    for r in range(4):
        inp = case.rank_inputs(case.config, d, r, 4)
        k = case.config["k"]
        assert not torch.equal(route_biased(inp["logits"], k, inp["bias"])[0],
                               route_biased(inp["logits"], k, torch.zeros_like(inp["bias"]))[0]), r


def test_ep_and_etp_on_4_ranks():
    from tests.procs import every_rank_says_ok
    every_rank_says_ok(__file__, 4, timeout=120)


def _rank_main():
    import torch.distributed as dist

    from launch.dist import init_process_group
    from reference.expert_parallel import EPMoE, ETPMoE
    from tpkit.ledger import CommLedger
    rank, world, _ = init_process_group()
    torch.manual_seed(0)
    wr, w1, w2, x, dy = _weights(1)
    xs, dys = x.chunk(4), dy.chunk(4)
    groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 4: [dist.group.WORLD]}
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]      # rank = e * 2 + p
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    row = H * 4
    for t in (2, 4):
        g, r = groups[t][rank // t if t == 2 else 0], rank % t
        base = rank - r                                                 # the group's first rank: its tokens
        xd = x[base * N:(base + t) * N].clone().requires_grad_(True)
        wrd, w1d, w2d = (w.clone().requires_grad_(True) for w in (wr, w1, w2))
        yd, _ = dense_moe(xd, wrd, w1d, w2d, K, C, t)
        yd.backward(dy[base * N:(base + t) * N])
        lo, hi = r * E // t, (r + 1) * E // t
        layer = EPMoE(wr, w1[lo:hi], w2[lo:hi], K, C, group=g)
        xi = xs[rank].clone().requires_grad_(True)
        with CommLedger(t) as L:
            L.set_phase("forward")
            y = layer(xi)
            L.set_phase("backward")
            y.backward(dys[rank])
        assert torch.allclose(y, yd.chunk(t)[r], atol=1e-5)
        assert torch.allclose(xi.grad, xd.grad.chunk(t)[r], atol=1e-5)
        assert torch.allclose(layer.w1.grad, w1d.grad[lo:hi], atol=1e-5)
        assert torch.allclose(layer.w2.grad, w2d.grad[lo:hi], atol=1e-5)
        mine = torch.zeros_like(wr).requires_grad_(True)                 # the router grad from my tokens only
        (dense_moe(xs[rank], wr + mine, w1, w2, K, C, 1)[0] * dys[rank]).sum().backward()
        assert torch.allclose(layer.router.grad, mine.grad, atol=1e-5)
        # the split sizes and bytes the ledger saw = those of the dense routing
        routes = [route(xc @ wr.T, K, C) for xc in x[base * N:(base + t) * N].chunk(t)]
        kept = torch.stack([torch.bincount(rt.experts[rt.keep], minlength=E) for rt in routes])   # (src, E)
        per_rank = kept.view(t, t, E // t).sum(2)                       # (src, dst) rows
        assert L.counts("forward") == {"all_to_all": 3} and L.counts("backward") == {"all_to_all": 2}
        fwd = [e for e in L.entries if e["phase"] == "forward"]
        assert fwd[1]["in_splits"] == per_rank[r].tolist() and fwd[1]["out_splits"] == per_rank[:, r].tolist()
        send, recv = (per_rank[r].sum() - per_rank[r, r]) * row, (per_rank[:, r].sum() - per_rank[r, r]) * row
        assert fwd[0]["sent"] == (t - 1) / t * E * 8                     # the counts: E int64, even
        assert fwd[1]["sent"] == send and fwd[2]["sent"] == recv
        assert L.bytes_sent("backward") == send + recv
    # dropless (C = None) on 4 ranks: the same layer, every assignment dispatched
    xd = x.clone().requires_grad_(True)
    yd, _ = dense_moe(xd, wr, w1, w2, K, None, 4)
    yd.backward(dy)
    layer = EPMoE(wr, w1[rank * 2:(rank + 1) * 2], w2[rank * 2:(rank + 1) * 2], K, None)
    xi = xs[rank].clone().requires_grad_(True)
    with CommLedger(4) as L:
        y = layer(xi)
        y.backward(dys[rank])
    sent = [e for e in L.entries if e["op"] == "all_to_all"][1]["in_splits"]
    assert sum(sent) == N * K and torch.allclose(y, yd.chunk(4)[rank], atol=1e-5)
    assert torch.allclose(xi.grad, xd.grad.chunk(4)[rank], atol=1e-5)
    # the all-gather dispatcher: same values, all-gather + reduce-scatter, (t-1) N H b each way per rank
    from reference.expert_parallel import AllGatherMoE
    w1d, w2d, wrd = (w.clone().requires_grad_(True) for w in (w1, w2, wr))
    xd = x.clone().requires_grad_(True)
    yd, _ = dense_moe(xd, wrd, w1d, w2d, K, None, 4)
    yd.backward(dy)
    layer = AllGatherMoE(wr, w1[rank * 2:(rank + 1) * 2], w2[rank * 2:(rank + 1) * 2], K, None)
    xi = xs[rank].clone().requires_grad_(True)
    with CommLedger(4) as L:
        L.set_phase("forward")
        y = layer(xi)
        L.set_phase("backward")
        y.backward(dys[rank])
    assert torch.allclose(y, yd.chunk(4)[rank], atol=1e-5)
    assert torch.allclose(xi.grad, xd.grad.chunk(4)[rank], atol=1e-5)
    assert torch.allclose(layer.w1.grad, w1d.grad[rank * 2:(rank + 1) * 2], atol=1e-5)
    mine = torch.zeros_like(wr).requires_grad_(True)
    (dense_moe(xs[rank], wr + mine, w1, w2, K, None, 1)[0] * dys[rank]).sum().backward()
    assert torch.allclose(layer.router.grad, mine.grad, atol=1e-5)
    assert L.counts("forward") == {"all_gather": 2, "reduce_scatter": 1}
    assert L.bytes_sent("forward") == 3 * N * (2 * H + E) * 4           # x and weights gathered, y scattered
    # EP 2 x ETP 2 on the 4 ranks' tokens
    e, p = rank // 2, rank % 2
    xd = x.clone().requires_grad_(True)
    w1d, w2d = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    yd, _ = dense_moe(xd, wr, w1d, w2d, K, C, 4)
    yd.backward(dy)
    el, fl = slice(e * E // 2, (e + 1) * E // 2), slice(p * F // 2, (p + 1) * F // 2)
    layer = ETPMoE(wr, w1[el, fl], w2[el, :, fl], K, C, ep_groups[p], tp_groups[e])
    xi = xs[rank].clone().requires_grad_(True)
    with CommLedger(2) as L:
        y = layer(xi)
        y.backward(dys[rank])
    assert torch.allclose(y, yd.chunk(4)[rank], atol=1e-5)
    assert torch.allclose(xi.grad, xd.grad.chunk(4)[rank], atol=1e-5)
    assert torch.allclose(layer.w1.grad, w1d.grad[el, fl], atol=1e-5)
    assert torch.allclose(layer.w2.grad, w2d.grad[el, :, fl], atol=1e-5)
    assert L.counts() == {"all_to_all": 5 + 4, "all_gather": 1}      # counts, dispatch, AG-v, RS-v, combine; 4 back
    # the ledger counts an uneven functional all_to_all_single row by row too
    import torch.distributed._functional_collectives as fc
    with CommLedger(4) as L:
        fc.all_to_all_single(torch.ones(4 * (rank + 1), H), [s + 1 for s in range(4)], [rank + 1] * 4, dist.group.WORLD) + 0
    (e,) = L.entries
    assert e["in_splits"] == [rank + 1] * 4 and e["out_splits"] == [1, 2, 3, 4] and e["sent"] == 3 * (rank + 1) * row
    print("ok", flush=True)


if __name__ == "__main__":
    _rank_main()
