"""Single-device references. Computed in the trusted process from the full tensors,
never from a student's shards (rebuilding the reference from the shards proves nothing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_(True)


def dense_linear(x, weight, bias, dy) -> dict:
    """y = x W^T + b and its grads: the dense answer for column- and row-parallel linears."""
    x, w, b = _leaf(x), _leaf(weight), _leaf(bias)
    y = F.linear(x, w, b)                         # (..., out)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dW": w.grad}
    if b is not None:
        out["db"] = b.grad
    return out


def dense_mlp(x, w1, b1, w2, b2, dy) -> dict:
    """Megatron MLP on one device: y = GeLU(x W1^T + b1) W2^T + b2."""
    x, w1, b1, w2, b2 = map(_leaf, (x, w1, b1, w2, b2))
    h = F.gelu(F.linear(x, w1, b1))               # (..., ffn)
    y = F.linear(h, w2, b2)                       # (..., hidden)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW1": w1.grad, "db1": b1.grad, "dW2": w2.grad, "db2": b2.grad}
