"""The full model from the owners' slices, at a round boundary.

Every owner sends its stored cut slices (:meth:`~thinwire.strategies.ist.store.Store.owned_flat`)
to the ranks assembling the model; those place every owner's slices into full-size tensors and
take the shared tensors from their own store. :func:`gather_full` returns the tensors (None on
ranks that do not assemble); :class:`~thinwire.strategies.ist.core.IST` makes a model of them
(``full_model``: a copy; ``finish``: the user's model itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from thinwire.runtime.comm import Comm
from thinwire.strategies.ist.store import Store


def gather_full(store: Store, comm: Comm, tensors: Mapping[str, torch.Tensor],
                to: Sequence[int], tag: str) -> dict[str, torch.Tensor] | None:
    """Every tensor whole on the ranks in ``to`` (``tensors``: the model's, for dtypes of
    tensors this rank stores nothing of)."""
    v = store.view
    flat = store.owned_flat()
    sizes = [store.owned_numel(o) for o in range(comm.world_size)]
    sends = [(d, flat) for d in to if d != v.rank and flat.numel()]
    recvs = ([(o, torch.empty(sizes[o], device=v.device, dtype=v.wire))
              for o in range(comm.world_size) if o != v.rank and sizes[o]]
             if v.rank in to else [])
    comm.exchange(sends, recvs, tag=tag)
    if v.rank not in to:
        return None
    full: dict[str, torch.Tensor] = {}
    for t in v.plan.tensors:
        like = store.slices.get(t.name)
        if like is not None and t.shared:
            full[t.name] = like.clone()
            continue
        dtype = like.dtype if like is not None else tensors[t.name].dtype
        full[t.name] = torch.empty(t.shape, device=v.device, dtype=dtype)
    for o, buf in [(v.rank, flat), *recvs]:
        store.unpack_owner(o, buf, full)
    return full
