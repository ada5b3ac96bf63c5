"""No key in a rank: nothing a grading rank receives (its spec.json, its own inputs) lets it rebuild data it does
not own. The attacker modelled here knows the public case code and tries every integer a rank can see as the seed
of the case's input maker; a seed of the trusted side, or a seed that made a weight, must never be among them."""
import dataclasses
import json
import re

import pytest
import torch

from grader.autograde.nbgrader_tools import weeks
from grader.judge.case import cases_of_week, get_case
from grader.judge.job import draw_seeds, plan_items, rank_views
from grader.rank.exchange import Item, JobSpec


def _ints_in(obj) -> set[int]:
    """Every integer a rank could read out of `obj`: JSON numbers, integer tensors' elements, integral floats."""
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().flatten()
        if flat.is_floating_point():
            flat = flat[torch.isfinite(flat) & (flat == flat.round())]
        return {int(v) for v in flat.to(torch.int64).unique().tolist()} if flat.numel() else set()
    if isinstance(obj, dict):
        return set().union(*(_ints_in(v) for v in obj.values())) if obj else set()
    return set()


def test_an_item_carries_no_seed():
    assert "seed" not in {f.name for f in dataclasses.fields(Item)}


def test_grading_draws_public_cases_fresh_too():
    """A public case's fixed seed is printed in the course's code: grading must not use it (the student could
    hard-code the inputs it makes)."""
    items = plan_items(["week02/column_parallel", "week02/mlp"])
    drawn = [draw_seeds(items) for _ in range(3)]
    for it in items:
        assert all(d[it.id] != get_case(it.case).seed for d in drawn)
    assert len({d[items[0].id] for d in drawn}) == 3
    assert draw_seeds(items, fresh_seed=False)[items[0].id] == get_case("week02/column_parallel").seed


@pytest.mark.parametrize("week", weeks())
def test_no_seed_reaches_a_rank(week, tmp_path):
    items = plan_items([c.name for c in cases_of_week(week)])
    seeds = draw_seeds(items)
    inputs = {it.id: get_case(it.case).make_inputs(it.config, torch.Generator().manual_seed(seeds[it.id]))
              for it in items}
    spec = tmp_path / "spec.json"
    JobSpec(items=items, pg_timeout=1.0, inputs="inputs/rank{rank}.pt", student="student").save(str(spec))
    text = spec.read_text()
    seen = {int(n) for n in re.findall(r"\d+", text)}
    for view in rank_views(items, inputs):
        for own in view.values():
            seen |= _ints_in(own)
    # the trusted side's keys: every item's seed (torch keeps its low 32 bits), and any seed-like value the case
    # drew for itself (a weight seed: an integer tensor of one element)
    keys = {s & 0xFFFFFFFF for s in seeds.values()} | {s for s in seeds.values()}
    for full in inputs.values():
        keys |= {int(v) for v in full.values() if v.numel() == 1 and not v.is_floating_point() and int(v) > 1 << 16}
    assert not keys & seen, f"{week}: a rank can read {sorted(keys & seen)[:3]}, a key of the trusted side"
    # and the public seeds: a rank's data made with them is not the graded data
    for it in items:
        public = get_case(it.case).make_inputs(it.config, torch.Generator().manual_seed(get_case(it.case).seed or 0))
        assert not all(torch.equal(public[k], v) for k, v in inputs[it.id].items() if k != "unused") \
            or inputs[it.id].keys() <= {"unused"}
    assert "seed" not in json.loads(text)["items"][0]
