"""Published measurements the planner is checked against (numbers copied from the papers).

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198): Fig. 1 memory per GPU (as restated in shared/references/costmodel.md),
  Table 3 configurations and Table 5 end-to-end iteration times on A100-80GB (Selene), data
  parallel size 1: full recompute 1.42 / 18.13 / 49.05 / 94.42 s and sequence parallel +
  selective recompute 1.10 / 13.75 / 37.83 / 71.49 s for 22B / 175B / 530B / 1T. Interleaving
  v = 3 for 175B and 530B (Table 3 note), none otherwise.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC'21, arXiv 2104.04473), Table 1: achieved TFLOP/s per GPU (counted with
  Eq. 3, i.e. with full recompute) for 1.7B-1T GPT models, V = 51200, s = 2048. Micro-batch
  sizes, interleaving and DDP flavour come from the authors' reproduction script
  NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (Table 1 itself does not list them).
Both papers' Megatron materializes the attention scores (a fused softmax, no flash kernel), so
their strategies say ``attention="materialized"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.planner.specs import TransformerSpec
from thinwire.planner.strategy import StrategySpec


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: what was trained, how, and what the paper reports."""

    source: str
    label: str
    model: TransformerSpec
    strategy: StrategySpec
    measured: float
    """Seconds per iteration (Korthikanti) or achieved TFLOP/s per GPU (Narayanan)."""
    metric: str
    """"iteration_s" or "tflops_per_gpu"."""


@dataclass(frozen=True)
class MemoryPoint:
    """Korthikanti Fig. 1: GiB per GPU of one configuration."""

    label: str
    model: TransformerSpec
    strategy: StrategySpec
    model_states_gib: float
    activations_gib: float


def _gpt(name: str, layers: int, hidden: int, heads: int) -> TransformerSpec:
    return TransformerSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200
    )


def korthikanti_models() -> dict[str, tuple[TransformerSpec, int, int, int, int]]:
    """Table 3: model, t, p, global batch (= m * b, d = 1), micro-batch, as name -> tuple."""
    return {
        "22B": (_gpt("megatron-22b", 48, 6144, 64), 8, 1, 4, 4),
        "175B": (_gpt("megatron-175b", 96, 12288, 96), 8, 8, 64, 1),
        "530B": (_gpt("megatron-530b", 105, 20480, 128), 8, 35, 280, 1),
        "1T": (_gpt("megatron-1t", 128, 25600, 160), 8, 64, 512, 1),
    }


def _korthikanti_strategy(name: str, recompute: str, sp: bool) -> StrategySpec:
    """Table 3's strategy of ``name`` (d = 1; v = 3 for 175B and 530B)."""
    _, t, p, batch, b = korthikanti_models()[name]
    v = 3 if name in ("175B", "530B") else 1
    return StrategySpec(
        dp=1,
        tp=t,
        pp=p,
        micro_batch_size=b,
        micro_batches=batch // b,
        interleave=v,
        recompute=recompute,
        sequence_parallel=sp,
        attention="materialized",
        dtype="bf16",
    )


def korthikanti_memory() -> list[MemoryPoint]:
    """Fig. 1 points for 22B and 175B (GiB per GPU, 18 B/param, layers only)."""
    out = []
    for name, states, plain, saved in (("22B", 45.56, 59.25, 9.56), ("175B", 45.56, 66.84, 12.35)):
        model = korthikanti_models()[name][0]
        out.append(
            MemoryPoint(
                f"{name} no recompute",
                model,
                _korthikanti_strategy(name, "none", False),
                states,
                plain,
            )
        )
        out.append(
            MemoryPoint(
                f"{name} SP + selective",
                model,
                _korthikanti_strategy(name, "selective", True),
                states,
                saved,
            )
        )
    return out


def korthikanti_times() -> list[PublishedRun]:
    """Table 5 iteration times, seconds."""
    measured = {
        "22B": (1.42, 1.10),
        "175B": (18.13, 13.75),
        "530B": (49.05, 37.83),
        "1T": (94.42, 71.49),
    }
    out = []
    for name, (full, present) in measured.items():
        model = korthikanti_models()[name][0]
        out.append(
            PublishedRun(
                "Korthikanti 2022 T5",
                f"{name} full recompute",
                model,
                _korthikanti_strategy(name, "full", False),
                full,
                "iteration_s",
            )
        )
        out.append(
            PublishedRun(
                "Korthikanti 2022 T5",
                f"{name} SP + selective",
                model,
                _korthikanti_strategy(name, "selective", True),
                present,
                "iteration_s",
            )
        )
    return out


def narayanan_table1() -> list[PublishedRun]:
    """Table 1 weak scaling (fp16, full recompute, scatter/gather), TFLOP/s per GPU."""
    rows = (  # label, heads, hidden, layers, t, p, GPUs, batch, micro-batch, v, torch DDP, TFLOP/s
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, True, 137.0),
        ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, True, 138.0),
        ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, True, 142.0),
        ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, True, 135.0),
        ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, False, 138.0),
        ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, False, 140.0),
        ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, False, 148.0),
        ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, False, 155.0),
        ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, False, 163.0),
        ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, False, 163.0),
    )
    return [_narayanan_run(*row) for row in rows]


def _narayanan_run(label: str, a: int, h: int, layers: int, t: int, p: int, gpus: int,
                   batch: int, b: int, v: int, torch_ddp: bool, tflops: float) -> PublishedRun:
    """One row of Table 1 as a run: d = GPUs / (t p), m = batch / (b d), fp16, full recompute."""
    d = gpus // (t * p)
    s = StrategySpec(dp=d, tp=t, pp=p, micro_batch_size=b, micro_batches=batch // (b * d),
                     interleave=v, recompute="full", attention="materialized", dtype="fp16",
                     accounting="zero", overlap_dp=torch_ddp)
    model = _gpt(f"gpt-{label}", layers, h, a)
    return PublishedRun("Narayanan 2021 T1", label, model, s, tflops, "tflops_per_gpu")
