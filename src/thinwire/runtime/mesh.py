"""The device mesh: data x pipeline x tensor parallel groups, each a Comm on one shared ledger.

Rank layout (row-major over (dp, pp, tp), as torch's DeviceMesh and Megatron): rank =
(d * pp + p) * tp + t, so tensor-parallel peers are neighbours, then pipeline stages, then data
replicas. ``Mesh(comm, dp=..., pp=..., tp=...)`` builds one sub-communicator per dimension for
this rank through :class:`torch.distributed.device_mesh.DeviceMesh` (every rank must build the
mesh, in the same order: group creation is collective); each sub-communicator records into the
parent's ledger, so one rank's counters hold all of its traffic whatever group carried it. A
dimension of size 1 is a local communicator (no group, no messages). Each sub-communicator
holds the parent's run device, so the device rule (:mod:`thinwire.runtime.comm`) holds on all.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm

DIMS = ("data", "pipe", "tensor")
"""Mesh dimension names (as torch's DeviceMesh sees them)."""


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    tp: int


class Mesh:
    """Sub-communicators of the dp x pp x tp mesh for this rank (module docstring)."""

    def __init__(self, comm: Comm, *, dp: int, pp: int = 1, tp: int = 1,
                 device_type: str = "cpu") -> None:
        if min(dp, pp, tp) < 1 or dp * pp * tp != comm.world_size:
            raise UsageError(f"mesh dp x pp x tp = {dp} x {pp} x {tp} does not match the "
                             f"{comm.world_size} workers; choose degrees whose product is that")
        self.comm = comm
        self.shape = dict(zip(DIMS, (dp, pp, tp)))
        r = comm.rank
        self.coords = Coords(dp=r // (pp * tp), pp=(r // tp) % pp, tp=r % tp)
        self._comms: dict[str, Comm] = {}
        if comm.world_size == 1 or max(pp, tp) == 1:
            for name in DIMS:
                self._comms[name] = comm if self.shape[name] == comm.world_size else \
                    Comm.local(comm.ledger, device=comm.device)
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=DIMS)
        for name in DIMS:
            if self.shape[name] == 1:
                self._comms[name] = Comm.local(comm.ledger, device=comm.device)
            else:
                self._comms[name] = Comm(mesh.get_group(name), ledger=comm.ledger,
                                         device=comm.device)
        self.device_mesh = mesh

    @property
    def dp(self) -> Comm:
        return self._comms[DIMS[0]]

    @property
    def pp(self) -> Comm:
        return self._comms[DIMS[1]]

    @property
    def tp(self) -> Comm:
        return self._comms[DIMS[2]]

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at mesh coordinates (dp, pp, tp)."""
        return (dp * self.shape[DIMS[1]] + pp) * self.shape[DIMS[2]] + tp
