"""The pipeline method's traffic: the ledger's totals per rank as a pure function of the run's
:class:`~thinwire.strategies.pipeline.plan.PipelinePlan` and the method's options.

Per step, stage s sends M forward payloads over boundary s and M backward payloads over boundary
s - 1 (each the boundary codec's ``tensor_bytes`` of the micro-batch's boundary shape, the
uncompressed size where ``uncompressed_first`` or ``epilogue_only`` leave a message plain) and
receives the mirror image; with dp > 1 one all-reduce of 4 P_s bytes (P_s: the stage's
parameters, the rank's slices with T > 1, plus what a bottleneck adds), ring estimate
2 (dp - 1) / dp of it on the wire; with clipping one all-reduce of 4 bytes over the S stages (with T > 1 another over the T
ranks first); with T > 1, per micro-batch and group sum of the stage, an all-reduce over the T ranks (or the
``tp_codec``'s collectives). ``options`` is the method's ``Options``
(:class:`thinwire.strategies.pipeline.method.Options`): ``micro_batches``, ``boundaries()``,
``tp_codec``.
"""

from __future__ import annotations

from typing import Any

from thinwire.errors import UsageError
from thinwire.strategies.pipeline.codecs import bottleneck_options, build_boundary, is_bottleneck
from thinwire.strategies.pipeline.plan import PipelinePlan
from thinwire.strategies.tp import collectives as tp_collectives
from thinwire.strategies.traffic import Layout, Traffic, ring_all_reduce, wire

__all__ = ["message_bytes", "traffic"]


def _bottleneck_params(spec: str, width: int) -> tuple[int, int]:
    """(encoder, decoder) parameters a bottleneck adds to the sending and receiving stage."""
    if not is_bottleneck(spec):
        return 0, 0
    name, o = bottleneck_options(spec)
    k = min(o.dim, width)
    return ((width * k + k, k * width + width) if name == "ae" else (0, 0))


def message_bytes(plan: PipelinePlan, options: Any
                  ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Per boundary b, the encoded bytes of micro-batch m's activation (``fwd[b][m]``) and of
    its gradient (``bwd[b][m]``), each the boundary codec's ``tensor_bytes`` of the message's
    shape; and the parameters each stage's bottleneck halves add (for the all-reduce)."""
    S, M = plan.stages, options.micro_batches
    bounds = options.boundaries()
    rows = plan.batch // M
    plain = build_boundary("none")
    fwd_bytes, bwd_bytes = [], []
    extra = [0] * S
    for b in range(S - 1):
        f, g = bounds.specs(b)
        shape = (rows, *plan.widths[b])
        if is_bottleneck(f):
            enc, dec = _bottleneck_params(f, shape[-1])
            extra[b] += enc
            extra[b + 1] += dec
            shape = (*shape[:-1], min(bottleneck_options(f)[1].dim, shape[-1]))
            f = "none"
        fwd_bytes.append([build_boundary(f, forward=True).tensor_bytes(shape)] * M)
        codec = build_boundary(g)
        bwd_bytes.append([codec.tensor_bytes(shape)
                          if bounds.compressed_backward(b, m, S, M) else plain.tensor_bytes(shape)
                          for m in range(M)])
    return fwd_bytes, bwd_bytes, extra


def traffic(layout: Layout, options: Any, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """The ledger's totals per rank after ``steps`` steps (the module docstring)."""
    del seed, optimizer_states
    plan = layout.pipeline
    if not isinstance(plan, PipelinePlan):
        raise UsageError("the pipeline's traffic needs the run's stage plan: build the layout "
                         "with thinwire.strategies.pipeline.plan.pipeline_layout")
    S, dp, T, M = plan.stages, plan.dp, plan.tp, options.micro_batches
    if S * dp * T != workers:
        raise UsageError(f"{workers} workers are not {dp} replicas x {S} stages x {T} "
                         "tensor slices")
    comp = None
    if options.tp_codec != "none":
        from thinwire.compression import build

        comp = build(options.tp_codec, slot="tp")
    rows = plan.batch // M
    fwd_bytes, bwd_bytes, extra = message_bytes(plan, options)
    sent, recv, pay = [], [], []
    calls: dict[str, tuple[int, int]] = {}
    for r in range(workers):
        s = (r // T) % S
        out = (sum(fwd_bytes[s]) if s < S - 1 else 0) + (sum(bwd_bytes[s - 1]) if s > 0 else 0)
        into = (sum(fwd_bytes[s - 1]) if s > 0 else 0) + (sum(bwd_bytes[s]) if s < S - 1 else 0)
        p2p_calls = (M if s < S - 1 else 0) + (M if s > 0 else 0)
        grad = 4 * (plan.stage_params[s] + extra[s])
        ar = ring_all_reduce(grad, dp) if dp > 1 else 0
        clip = ring_all_reduce(4, S) if plan.clip and S > 1 else 0
        clip += ring_all_reduce(4, T) if plan.clip and T > 1 else 0
        # tensor parallelism: per micro-batch, each of the stage's group sums (an all-reduce,
        # or the codec's collectives)
        tp_calls = [c for n in (plan.tp_sums[s] if T > 1 else ())
                    for c in tp_collectives(comp, "sum", rows * n, T)]
        tp_wire = [(op, b if op == "all_to_all" else wire(op, b, T)) for op, b in tp_calls]
        tp = M * sum(w for _, w in tp_wire)
        n_ar = (dp > 1) + (plan.clip and S > 1) + (plan.clip and T > 1)
        sent.append(steps * (out + ar + clip + tp))
        recv.append(steps * (into + ar + clip + tp))
        pay.append(steps * (out + into + (grad if dp > 1 else 0) + 4 * ((plan.clip and S > 1) + (plan.clip and T > 1))
                            + M * sum(b for _, b in tp_calls)))
        if r == 0:
            calls = {"send": (steps * p2p_calls, steps * out)}
            if n_ar:
                calls["all_reduce"] = (steps * n_ar, steps * (ar + clip))
            for op, w in tp_wire:
                c, b = calls.get(op, (0, 0))
                calls[op] = (c + steps * M, b + steps * M * w)
    return Traffic(tuple(sent), tuple(recv), tuple(pay), calls)
