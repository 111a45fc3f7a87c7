"""A small decoder-only transformer language model in the GPT-2 layout.

Radford, Wu, Child, Luan, Amodei, Sutskever, "Language Models are Unsupervised Multitask
Learners" (OpenAI, 2019): the GPT decoder (Radford et al. 2018) with LayerNorm moved to the input
of each sub-block (pre-LayerNorm), a final LayerNorm after the last block, and residual
projections initialised with std 0.02 / sqrt(2 n_layer). Here it reads characters: the context
length is the dataset's window (``input_shape[0]``) and the vocabulary its ``num_classes``.

Forward pass for token ids ``idx`` [B, L] (int64), L <= context length:
  1. h = tok_emb(idx) + pos_emb(0 .. L-1), then dropout;
  2. for each :class:`Block` in ``blocks``: h = h + attn(ln1(h)); h = h + mlp(ln2(h));
  3. logits = head(ln_f(h)), [B, L, V].

:class:`CausalSelfAttention` has separate ``q``, ``k``, ``v`` (d_model -> heads x head_dim) and
``proj`` (heads x head_dim -> d_model) linear layers and a fixed ``head_dim``; it derives its
*current* number of heads from ``q.weight.shape[0] // head_dim`` at every call and attends with
``scaled_dot_product_attention(is_causal=True)``. :class:`FeedForward` is ``fc1`` (d_model ->
d_ff), ``act`` (GELU, tanh approximation as GPT-2), ``fc2`` (d_ff -> d_model). Neither stores a
head count or a hidden width, so a model holding a subset of heads (rows of q/k/v and their
biases, columns of proj) or of FFN neurons (rows of fc1 and its bias, columns of fc2) runs
unchanged: the units IST deals out to workers, tensor parallelism shards and pipeline stages
split (whole blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import Cut, ISTAdapter, ISTPlan, TensorPlan, UnitGroup
from thinwire.models.registry import ModelEntry
from thinwire.models.tensor_plan import Region, TPPlan
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with per-head rows in q, k, v and columns in proj."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        width = n_head * self.head_dim
        self.q = nn.Linear(d_model, width)
        self.k = nn.Linear(d_model, width)
        self.v = nn.Linear(d_model, width)
        self.proj = nn.Linear(width, d_model)
        self.attn_dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, d_model] -> [B, L, d_model]: 1. project to q, k, v and split into the heads
        present; 2. causal scaled dot-product attention per head; 3. concatenate the heads and
        project back (then dropout)."""
        b, n, _ = x.shape
        heads = self.q.weight.shape[0] // self.head_dim
        q, k, v = (lin(x).view(b, n, heads, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, n, heads * self.head_dim)
        return self.drop(self.proj(y))


class FeedForward(nn.Module):
    """The position-wise MLP: fc2(GELU(fc1(x))), then dropout."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, d_ff, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer LM: token ids [B, L] -> next-token logits [B, L, vocab]."""

    def __init__(self, vocab: int, context: int, *, n_layer: int = 2, n_head: int = 4,
                 d_model: int = 128, d_ff: int = 0, tie_embeddings: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self._init_weights(n_layer)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2: every linear and embedding weight N(0, 0.02^2), biases 0, LayerNorm 1 and 0;
        the residual projections (attn.proj, mlp.fc2) N(0, (0.02 / sqrt(2 n_layer))^2)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * max(n_layer, 1))
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=residual_std)

    @property
    def context(self) -> int:
        """The longest sequence the positional embedding covers."""
        return self.pos_emb.num_embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, vocab] for token ids ``idx`` [B, L] (steps of the module docstring)."""
        h = embed(self.tok_emb, self.pos_emb, self.drop, idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def embed(tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Module,
          idx: torch.Tensor) -> torch.Tensor:
    """Step 1 of the forward pass: token plus position embeddings of ``idx``, then dropout."""
    n = idx.shape[-1]
    if n > pos_emb.num_embeddings:
        raise ValueError(f"sequence of {n} tokens exceeds the context length "
                         f"{pos_emb.num_embeddings}")
    pos = torch.arange(n, device=idx.device)
    return drop(tok_emb(idx) + pos_emb(pos))


class Embed(nn.Module):
    """The GPT's first link of :func:`gpt_chain`: step 1 (its embeddings, shared)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embed(self.tok_emb, self.pos_emb, self.drop, idx)


class Head(nn.Module):
    """The GPT's last link of :func:`gpt_chain`: step 3, logits = head(ln_f(h)) (shared)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))


def gpt_chain(model: nn.Module) -> list[nn.Module]:
    """The GPT as a chain (``ModelEntry.chain``): [Embed, block 0, ..., block L-1, Head], the
    modules sharing the model's parameters; composed in order they are ``model.forward``."""
    assert isinstance(model, GPT)
    return [Embed(model), *model.blocks, Head(model)]


@dataclass(frozen=True)
class Options:
    """``[model]`` options of the GPT."""

    n_layer: int = opt(2, "number of transformer blocks")
    n_head: int = opt(4, "attention heads per block (must divide d_model)")
    d_model: int = opt(128, "embedding width")
    d_ff: int = opt(0, "hidden width of each block's MLP (0: 4 x d_model)")
    tie_embeddings: bool = opt(False, "share the token embedding with the output head")
    dropout: float = opt(0.0, "dropout on embeddings, attention weights and residual branches")

    def __post_init__(self) -> None:
        check(self.n_layer >= 1, "model.n_layer", f"got {self.n_layer}; use an integer >= 1")
        check(self.n_head >= 1, "model.n_head", f"got {self.n_head}; use an integer >= 1")
        check(self.d_model >= 1, "model.d_model", f"got {self.d_model}; use an integer >= 1")
        check(self.d_model % self.n_head == 0, "model.d_model",
              f"{self.d_model} is not divisible by model.n_head={self.n_head}; use a multiple "
              f"of it")
        check(self.d_ff >= 0, "model.d_ff", f"got {self.d_ff}; use 0 (4 x d_model) or a width")
        check(0.0 <= self.dropout < 1.0, "model.dropout",
              f"got {self.dropout}; use a probability in [0, 1)")


def activation_bytes(options: Options, dataset: Dataset, batch: int, recompute: str) -> int:
    """Bytes the forward pass and the cross-entropy loss keep for backward (fp32, dropout 0:
    dropout adds its masks), from the shapes: B sequences of L = the dataset's window, width d,
    a heads, FFN width f, vocabulary V.

    Per block: 1. ``none``: 8 BLd + 2 BLf + (4 + a) BL: LayerNorm inputs (2), their outputs
    (2), q, k, v and the attention output (the fused kernel's output, laid out so the head merge
    is a view), fc1's output and GELU's output, the two
    LayerNorms' mean and rstd (4 BL) and the fused kernel's log-sum-exp (a BL); no attention
    scores (scaled_dot_product_attention never stores them); 2. ``block`` recompute: the block's
    input, BLd; 3. ``selective`` (attention recomputed): 4 BLd + 2 BLf + 4 BL. Outside the
    blocks: token ids and positions (int64), the final LayerNorm's input and statistics, the
    head's input, the log-softmax output B L V and the int64 targets."""
    e = 4
    b, n, v = batch, dataset.input_shape[0], dataset.num_classes
    d, a = options.d_model, options.n_head
    f = options.d_ff or 4 * d
    bl = b * n
    per_block = {"none": 8 * bl * d + 2 * bl * f + (4 + a) * bl,
                 "block": bl * d,
                 "selective": 4 * bl * d + 2 * bl * f + 4 * bl}[recompute]
    outside = (bl * d + 2 * bl) + bl * d + bl * v + 1
    return e * (options.n_layer * per_block + outside) + 8 * (2 * bl + n)


def build_gpt(options: Options, dataset: Dataset, seed: int) -> GPT:
    """The GPT for ``dataset`` (a ``sequence`` dataset: context = ``input_shape[0]``,
    vocabulary = ``num_classes``) with weights drawn from ``seed`` (identical on every rank)."""
    if dataset.kind != "sequence" or len(dataset.input_shape) != 1:
        raise UsageError(
            f"model gpt needs token sequences (a 'sequence' dataset such as tinyshakespeare), "
            f"but {dataset.name} is a '{dataset.kind}' dataset with input shape "
            f"{tuple(dataset.input_shape)}; pick --data.name tinyshakespeare")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(dataset.num_classes, dataset.input_shape[0], n_layer=options.n_layer,
                   n_head=options.n_head, d_model=options.d_model, d_ff=options.d_ff,
                   tie_embeddings=options.tie_embeddings, dropout=options.dropout)


def tensor_plan(model: nn.Module) -> TPPlan:
    """Megatron's split of the GPT (:mod:`thinwire.models.tensor_plan`): per block, attention by
    heads (q, k, v column-parallel in units of ``head_dim`` rows, ``proj`` row-parallel) and the
    MLP by neurons (``fc1`` column, ``fc2`` row); the blocks are the sequence-parallel span.
    Embeddings, the final LayerNorm and the head stay whole on every rank."""
    assert isinstance(model, GPT)
    regions: list[Region] = []
    span: list[str] = []
    for i, block in enumerate(model.blocks):
        assert isinstance(block, Block)
        regions.append(Region(f"blocks.{i}.attn", ("q", "k", "v"), ("proj",),
                              unit=block.attn.head_dim))
        regions.append(Region(f"blocks.{i}.mlp", ("fc1",), ("fc2",)))
        span.append(f"blocks.{i}")
    return TPPlan(tuple(regions), tuple(span), seq_dim=1,
                      width=model.tok_emb.embedding_dim, seq_len=model.context)


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).replace("torch.", "")


class GPTAdapter(ISTAdapter):
    """Independent Subnetwork Training of the GPT (Yuan et al., VLDB 2022, carried from neurons
    to a transformer's own units).

    Per block l, two disjoint groups, cut afresh each round:
    1. ``heads.l``, the attention heads: the rows of ``attn.q``, ``attn.k`` and ``attn.v``
       (weights and biases) per head, ``per_unit = head_dim``, and the same columns of
       ``attn.proj.weight``: a subnet attends with its own heads only (the attention derives its
       head count from the weight shapes);
    2. ``ffn.l``, the feed-forward neurons: the rows of ``mlp.fc1`` (and its bias) and the
       columns of ``mlp.fc2.weight``, as IST's hidden layers;
    3. shared by every subnet and averaged over all ranks after each round: the token and
       position embeddings, every LayerNorm (they normalise ``d_model``, which is never cut),
       the biases of ``attn.proj`` and ``mlp.fc2`` (added once to the residual stream) and the
       output head (or the tied embedding).
    4. Activation scaling, ``dropout`` by default: a subnet holding 1/n of a block's heads and
       FFN neurons adds a residual update made of 1/n of the terms of the full model's, so
       ``proj``'s and ``fc2``'s inputs are multiplied by units / held (inverted dropout). The
       assembled full model then adds, in expectation over the partition, the update every
       subnet was trained to add, and evaluation needs no correction. ``none`` trains the
       subnets unscaled: each learns to make the whole update with 1/n of the units, and the
       full model's branches add n of them. ``dropout`` against ``none`` is measured in one
       row of docs/benchmarks/ist-models.md ("IST beyond fully connected nets", the GPT table;
       its command is ``benchmarks/ist_models.py gpt``).
    """

    scales = ("dropout", "none")

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, GPT):
            raise UsageError(f"GPTAdapter cuts thinwire's GPT, got {type(model).__name__}")
        groups: list[UnitGroup] = []
        cuts: dict[str, tuple[Cut, ...]] = {}
        scaled: list[tuple[str, str]] = []
        for layer, block in enumerate(model.blocks):
            assert isinstance(block, Block)
            pre, hd = f"blocks.{layer}.", block.attn.head_dim
            heads, ffn = f"heads.{layer}", f"ffn.{layer}"
            groups.append(UnitGroup(heads, block.attn.q.weight.shape[0] // hd))
            groups.append(UnitGroup(ffn, block.mlp.fc1.weight.shape[0]))
            for lin in ("q", "k", "v"):
                cuts[f"{pre}attn.{lin}.weight"] = (Cut(heads, 0, hd),)
                cuts[f"{pre}attn.{lin}.bias"] = (Cut(heads, 0, hd),)
            cuts[f"{pre}attn.proj.weight"] = (Cut(heads, 1, hd),)
            cuts[f"{pre}mlp.fc1.weight"] = (Cut(ffn, 0),)
            cuts[f"{pre}mlp.fc1.bias"] = (Cut(ffn, 0),)
            cuts[f"{pre}mlp.fc2.weight"] = (Cut(ffn, 1),)
            scaled += [(f"{pre}attn.proj", heads), (f"{pre}mlp.fc2", ffn)]
        tensors = [TensorPlan(name, tuple(p.shape), cuts.get(name, ()), dtype=_dtype(p))
                   for name, p in model.named_parameters()]
        persistent = dict(model.state_dict(keep_vars=True))
        tensors += [TensorPlan(name, tuple(b.shape), buffer=True, dtype=_dtype(b))
                    for name, b in model.named_buffers() if name in persistent]
        super().__init__(ISTPlan(groups=tuple(groups), tensors=tuple(tensors),
                                 scaled_inputs=tuple(scaled)))


MODEL = ModelEntry(
    name="gpt", summary="decoder-only transformer LM, pre-LayerNorm GPT-2 layout, char level",
    build=build_gpt, data_kinds=("sequence",), default_data="tinyshakespeare", options=Options,
    blocks=(r"blocks\.\d+",), selective=(r"blocks\.\d+\.attn",), activations=activation_bytes,
    chain=gpt_chain, tensor=tensor_plan,
    ist=GPTAdapter)
