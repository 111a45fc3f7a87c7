"""Flat gradients: the pieces several methods share to move many tensors in one collective.

A method that averages gradients itself (instead of through DDP's buckets) does, in steps:
  1. :func:`grads_of`: each parameter's gradient, zeros where it has none (a parameter the
     step did not reach still takes part, so every rank sends the same number of elements);
  2. :func:`flatten`: the tensors concatenated into one flat tensor, in order;
  3. one collective on the flat tensor (``Comm.all_reduce``: one ledger entry);
  4. :func:`unflatten_into`: the result copied back into the tensors, in the same order.
:func:`all_reduce_grads` is steps 1-4 with the result set as each parameter's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from thinwire.runtime.comm import Comm

__all__ = ["all_reduce_grads", "flatten", "grads_of", "unflatten_into"]


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Step 1: each parameter's ``grad``, or zeros like the parameter where it has none."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 2: the tensors' elements concatenated in order (a new 1-D tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Step 4: consecutive slices of ``flat`` copied into ``tensors`` in place (inverse of
    :func:`flatten`)."""
    i = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[i:i + n].view_as(t))
        i += n


def all_reduce_grads(comm: Comm, params: Sequence[torch.Tensor], *, op: str = "avg",
                     tag: str = "grad") -> None:
    """Steps 1-4: the parameters' gradients reduced over ``comm`` (``op`` "avg" or "sum") in
    one all-reduce tagged ``tag``; each parameter's ``grad`` becomes its slice of the result."""
    flat = flatten(grads_of(params))
    comm.all_reduce(flat, op=op, tag=tag)
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p).clone()
        i += n
