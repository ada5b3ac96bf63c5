"""DTensor parallelize plans for the lectures (the Week 7 lab asks students to write their own)."""
from __future__ import annotations


def pad_reference(input_ids, labels, multiple: int, ignore_index: int = -100):
    """Right-pad (B, T) ids with 0 and labels with ignore_index to a multiple of `multiple` (week 7's lab asks for it
    as pad_for_sp: the lecture's copy lives here, where no student install reaches)."""
    import torch
    pad = (-input_ids.shape[1]) % multiple
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        labels = torch.nn.functional.pad(labels, (0, pad), value=ignore_index)
    return input_ids, labels


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
