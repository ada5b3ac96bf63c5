"""The course's teaching library: what lectures and students import, and all a grading rank may use.

models (the dense Llama-style model), ledger (collectives and bytes), memory (activation and
parameter probes, Korthikanti's formulas), timeline (per-rank compute/communication lanes),
gather_watch (gathered weights alive at once), pipeline (schedule simulator, stages), topology
(model and cluster specs), costmodel (bytes and FLOPs into time on named hardware), capstone_model (week 12's
Llama-MoE), dtensor (DTensor helpers), plots; and `check`, the lab self-check.
The reference implementations of what labs ask for are in `reference/`, which no grading rank sees.
"""


def check(*names: str, backend: str | None = None, launcher: str | None = None) -> None:
    from tpkit.selfcheck import check as run
    __tracebackhide__ = True  # noqa: F841
    run(*names, backend=backend, launcher=launcher)


check.__doc__ = "Self-check your lab modules on N ranks: check(\"week02/column_parallel\"). See tpkit.selfcheck."
