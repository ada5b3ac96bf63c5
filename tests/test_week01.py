"""Week 1 helpers without launching ranks: the ring simulation, the cases' references and contracts."""
import torch

from tpkit import plots
from grader.judge.case import get_case


def test_ring_simulation_ends_reduced_on_the_diagonal():
    for t in (2, 3, 4, 5):
        final = plots.ring_reduce_scatter_states(t)[-1]
        assert all(final[r][r] == 2 ** t - 1 for r in range(t))      # chunk r of rank r holds all t inputs
        assert len(plots.ring_reduce_scatter_states(t)) == t          # start + t - 1 steps


def test_reference_is_the_dense_sum_of_the_first_t_ranks():
    case = get_case("week01/reduce_scatter_hidden")
    inp = case.make_inputs(case.config, torch.Generator().manual_seed(1))
    ref = case.reference(case.config, inp)
    for t in (2, 3, 4):
        pieces = [case.expected(case.config, ref, r, t)["y"] for r in range(t)]
        assert torch.allclose(torch.cat(pieces), inp["x"][:t].sum(0).flatten())
        assert [p.numel() for p in pieces] == [c.numel() for c in torch.tensor_split(torch.empty(1001), t)]


def test_all_reduce_contract_is_the_ring_optimum():
    case = get_case("week01/all_reduce")
    n_bytes = 4 * 12 * 10
    for t in (2, 3, 4):
        c = case.contract(case.config, t)
        assert c.allowed_ops == {"send", "recv"}
        assert abs(c.bytes_sent["all"] - 2 * (t - 1) / t * n_bytes) < 1e-9
