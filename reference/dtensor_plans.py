"""DTensor parallelize plans for the lectures (the Week 7 lab asks students to write their own)."""
from __future__ import annotations





def tp_only_plans():
    """Megatron-style TP without SP (Weeks 3-4) as plans: (block plan, top-level plan).

    Activations stay replicated between sub-blocks, so no PrepareModuleInput is needed and the norms
    stay plain modules; each sub-block ends in an all-reduce (RowwiseParallel's default Replicate output).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    block = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    block.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                  "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
           "lm_head": ColwiseParallel(use_local_output=False)}       # vocab-sharded DTensor for loss_parallel
    return block, top
