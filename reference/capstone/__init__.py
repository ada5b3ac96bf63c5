"""Week 12: one model trained in 4-D (TP/SP x EP x PP x DP), with a checkpoint that reshards.

The recipe is torchtitan's (`torchtitan/distributed/parallel_dims.py`, `torchtitan/models/llama3/infra/
parallelize.py`; docs/sources.md names the commits read) and picotron's (4-D training of a Llama):
1. one validated object holds the degrees (`ParallelDims`); world = tp * pp * dp; EP borrows its ranks from DP;
2. the mesh orders the dimensions (pp, dp, tp), tp fastest: the TP group is consecutive ranks, one node's GPUs;
3. every process group the mesh implies is made once, by every rank, in one order (`build_groups`);
4. parallelisms are applied in torchtitan's order: the pipeline cuts the model into stages first, then TP/SP
   shards each stage's blocks (and CP would wrap attention), then EP places the experts, and data parallelism
   comes last, as a plan for the gradients (`grad_plan`): which gradient is summed over which group;
5. a step runs the 1F1B schedule (Week 9) over the stages; the checkpoint (torch.distributed.checkpoint) keeps
   every tensor under its dense name with its global offsets, so another layout reads the pieces it needs.

Built from the lectures' references: `reference.sp_layers` (TP/SP blocks, Week 5), `reference.vocab` (vocab-
parallel embedding and loss, Week 4), `reference.expert_parallel` (the EP layer, Week 11), `reference.schedules`
(1F1B, Week 9). The model is `tpkit.capstone_model.LlamaMoE`, untouched.

Split by idea: `layout` (the degrees, the mesh, the groups), `stage` (the parallel model), `step` (the gradient plan,
one 1F1B step, the single-device run), `checkpoint` (save, load, resharding), `comm` (bytes per dimension).
"""
from reference.capstone.checkpoint import checkpoint_state, load, save
from reference.capstone.comm import DimLedger, expected_bytes, moe_tokens_experts
from reference.capstone.layout import ParallelDims, build_groups
from reference.capstone.stage import ParallelMoELayer, Stage
from reference.capstone.step import (batches, data_of_rank, dense_run, dense_shard, grad_plan, make_optimizer,
                                     reduce_grads, train_step)

__all__ = ["ParallelDims", "build_groups", "Stage", "ParallelMoELayer", "grad_plan", "reduce_grads", "train_step",
           "data_of_rank", "make_optimizer", "dense_run", "dense_shard", "batches", "checkpoint_state", "save", "load",
           "DimLedger", "expected_bytes", "moe_tokens_experts"]
