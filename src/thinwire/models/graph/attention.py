"""Rules for torch's attention and transformer modules (:mod:`thinwire.models.graph.rules`):
``nn.MultiheadAttention`` cuts heads (``in_proj_weight`` rows in 3 segments of ``head_dim``,
``out_proj`` columns); ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` / ``Encoder`` /
``Decoder`` / ``Transformer`` are kept one node each and cut per layer into heads and FFN
neurons, their ``d_model`` a residual stream. A submodule of such a node named in ``shared``
(a layer's ``self_attn``, ``linear1`` or ``linear2``, a norm, or the whole layer) keeps the units
it indexes whole, as ``shared`` does for a module the tracer calls on its own."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from thinwire.models.graph.context import Context
from thinwire.models.graph.groups import Ann, Use, poison_ann


def _attention_groups(p: Context, name: str, m: nn.MultiheadAttention, a_in: Ann,
                      rank: int) -> int | None:
    """The heads group of ``m`` (None when it is not cut) and the uses of its input."""
    cuttable = (m._qkv_same_embed_dim and m.bias_k is None and not m.add_zero_attn
                and m.in_proj_weight is not None)
    last = rank - 1
    if last in a_in:
        gid, inner = a_in[last]
        p.consume(name, gid, inner, f"{name}.in_proj_weight", 1)
        if not cuttable:
            p.groups.poison(gid)
    if not cuttable:
        return None
    hd = m.head_dim
    uses = [Use(f"{name}.in_proj_weight", 0, hd, 3), Use(f"{name}.out_proj.weight", 1, hd)]
    if m.in_proj_bias is not None:
        uses.append(Use(f"{name}.in_proj_bias", 0, hd, 3))
    heads = p.new_group(m.num_heads, f"{name}.heads", uses)
    p.groups.scaled.append((f"{name}.out_proj", heads))
    p.groups.attentions[name] = (heads, hd)
    return heads


def _attention_out(p: Context, name: str, m: nn.MultiheadAttention, rank: int) -> Ann:
    uses = [Use(f"{name}.out_proj.weight", 0)]
    if m.out_proj.bias is not None:
        uses.append(Use(f"{name}.out_proj.bias", 0))
    return {rank - 1: (p.new_group(m.embed_dim, f"{name}.out_proj", uses), 1)}


def _attention(p: Context, n: fx.Node, name: str, m: nn.MultiheadAttention) -> Any:
    q, k, v = (n.args + (None, None, None))[:3]
    k = k if k is not None else n.kwargs.get("key")
    v = v if v is not None else n.kwargs.get("value")
    rank = len(p.shape(q))
    anns = [p.annotation(x) for x in (q, k, v)]
    last = rank - 1
    joined: Ann = {}
    for a in anns:
        for d, val in a.items():
            if d != last:
                p.groups.poison(val[0])
            elif last in joined:
                joined[last] = (p.groups.join(joined[last][0], val[0]), val[1])
            else:
                joined[last] = val
    if last in joined and not all(last in a for a in anns):
        p.groups.poison(joined[last][0])
    _attention_groups(p, name, m, joined, rank)
    return [_attention_out(p, name, m, rank), {}]


def _kept(p: Context, layer: str, *subs: str) -> bool:
    """The user keeps the layer, or one of its submodules ``subs``, whole (``shared``)."""
    return layer in p.shared or any(f"{layer}.{s}" in p.shared for s in subs)


def _layer(p: Context, name: str, m: nn.Module, d_ann: Ann, rank: int,
           memory: Ann | None) -> Ann:
    """One encoder/decoder layer: heads and FFN neurons; d_model in and out the same. A group
    whose module is named in ``shared`` (or the whole layer) is poisoned: not cut."""
    last = rank - 1
    attn = [("self_attn", d_ann)]
    if isinstance(m, nn.TransformerDecoderLayer):
        cross = dict(d_ann)
        if memory is not None and last in memory:
            cross = ({last: (p.groups.join(d_ann[last][0], memory[last][0]), 1)}
                     if last in d_ann else {})
            if last not in d_ann:
                p.groups.poison(memory[last][0])
        elif last in d_ann:
            p.groups.poison(d_ann[last][0])
        attn.append(("multihead_attn", cross))
    stream = dict(d_ann)
    for sub, a in attn:
        mha = getattr(m, sub)
        heads = _attention_groups(p, f"{name}.{sub}", mha, a, rank)
        if heads is not None and _kept(p, name, sub, f"{sub}.out_proj"):
            p.groups.poison(heads)
        out = _attention_out(p, f"{name}.{sub}", mha, rank)
        stream = _join_stream(p, stream, out, last)
    lin1: Any = m.linear1  # type: ignore[union-attr]
    lin2: Any = m.linear2  # type: ignore[union-attr]
    if last in stream:
        p.consume(f"{name}.linear1", stream[last][0], 1, f"{name}.linear1.weight", 1)
    ffn = p.new_group(lin1.out_features, f"{name}.linear1",
                    [Use(f"{name}.linear1.weight", 0), Use(f"{name}.linear1.bias", 0)]
                    if lin1.bias is not None else [Use(f"{name}.linear1.weight", 0)])
    p.consume(f"{name}.linear2", ffn, 1, f"{name}.linear2.weight", 1)
    if _kept(p, name, "linear1", "linear2"):
        p.groups.poison(ffn)
    out2 = {last: (p.new_group(lin2.out_features, f"{name}.linear2",
                             [Use(f"{name}.linear2.weight", 0)] +
                             ([Use(f"{name}.linear2.bias", 0)]
                              if lin2.bias is not None else [])), 1)}
    stream = _join_stream(p, stream, out2, last)
    for norm in ("norm1", "norm2", "norm3"):
        ln = getattr(m, norm, None)
        if ln is not None:
            _norm_on(p, f"{name}.{norm}", ln, stream, last)
    if last in stream and _kept(p, name, "norm1", "norm2", "norm3"):
        p.groups.poison(stream[last][0])
    return stream


def _join_stream(p: Context, stream: Ann, out: Ann, last: int) -> Ann:
    if last in stream:
        return {last: (p.groups.join(stream[last][0], out[last][0], stream=True), 1)}
    p.groups.poison(out[last][0])
    return {}


def _norm_on(p: Context, name: str, ln: nn.LayerNorm, stream: Ann, last: int) -> None:
    if last in stream:
        for t, _ in ln.named_parameters(recurse=False):
            p.groups.use(stream[last][0], Use(f"{name}.{t}", 0))
        p.groups.layer_norms[name] = (stream[last][0], stream[last][1])


def _stack(p: Context, name: str, m: nn.Module, a: Ann, rank: int, memory: Ann | None) -> Ann:
    stream = dict(a)
    for i, layer in enumerate(m.layers):  # type: ignore[union-attr, arg-type]
        stream = _layer(p, f"{name}.layers.{i}", layer, stream, rank, memory)
    norm = getattr(m, "norm", None)
    if isinstance(norm, nn.LayerNorm):
        _norm_on(p, f"{name}.norm", norm, stream, rank - 1)
        if rank - 1 in stream and f"{name}.norm" in p.shared:
            p.groups.poison(stream[rank - 1][0])
    return stream


def _transformer(p: Context, n: fx.Node, name: str, m: nn.Module) -> Any:
    args = [x for x in n.args if isinstance(x, fx.Node)]
    shapes = [p.shape(x) for x in args[:2]]
    rank = len(shapes[0])
    anns = [p.annotation(x) for x in args]
    for x in args[2:]:
        poison_ann(p.groups, p.ann.get(x))
    a = anns[0]
    for d in a:
        if d != rank - 1:
            p.groups.poison(a[d][0])
    a = {d: v for d, v in a.items() if d == rank - 1}
    if isinstance(m, nn.TransformerEncoderLayer):
        return _layer(p, name, m, a, rank, None)
    if isinstance(m, nn.TransformerEncoder):
        return _stack(p, name, m, a, rank, None)
    memory = anns[1] if len(anns) > 1 else {}
    if isinstance(m, nn.TransformerDecoderLayer):
        return _layer(p, name, m, a, rank, memory)
    if isinstance(m, nn.TransformerDecoder):
        return _stack(p, name, m, a, rank, memory)
    assert isinstance(m, nn.Transformer)  # (src, tgt)
    src = _stack(p, f"{name}.encoder", m.encoder, a, rank, None)
    tgt = {d: v for d, v in (anns[1] if len(anns) > 1 else {}).items() if d == rank - 1}
    return _stack(p, f"{name}.decoder", m.decoder, tgt, rank, src)
