"""The lectures' reference implementations of what the labs ask students to write.

TP layers, SP layers, vocab-parallel ops, overlapped linears, pipeline schedules, the 3-D planner,
DTensor plans. Lectures import them; a grading rank and the autograded notebook never see them.
"""

import torch


def backward(y: torch.Tensor, dy: torch.Tensor):
    """`y.backward(dy)` for a dense reference, as `(y * dy).sum().backward()`: the same grads bit for bit (the
    sum's grad is 1, times dy), without `backward(dy)`'s shape check, whose first call imports sympy (0.5 s of
    every check's trusted process)."""
    (y * dy).sum().backward()
