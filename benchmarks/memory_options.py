"""Memory options x models: the planner's prediction against 2-rank runs on this machine.

    PYTHONPATH=src python benchmarks/memory_options.py --data-dir ../shared/data

For the MLP and the GPT, plain dp and every ``[memory]`` option train 3 steps on 2 gloo ranks;
each row prints, for the most loaded rank, the predicted and measured parameter + gradient +
optimizer bytes, saved activations, gathered parameters, their sum (the peak when the backward
pass starts) and the ledger's bytes sent per rank against the prediction (the process's peak
resident set is in each run's summary.json, ``thinwire report``). The table in
docs/PLANNER.md ("Memory options held to runs") is this command's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

OPTIONS: dict[str, dict[str, str]] = {
    "none": {},
    "zero=1": {"memory.zero": "1"},
    "zero=2": {"memory.zero": "2"},
    "zero=3": {"memory.zero": "3"},
    "recompute=block": {"memory.recompute": "block"},
    "recompute=selective": {"memory.recompute": "selective"},
    "zero=3 + block + offload": {"memory.zero": "3", "memory.recompute": "block",
                                 "memory.offload": "params"},
}


def models(data_dir: str) -> dict[str, dict[str, str]]:
    common = {"runtime.workers": "2", "train.steps": "3", "train.optimizer": "adamw",
              "train.lr": "0.001"}
    return {
        "mlp 64-512-512-10 (digits, b=64)": {
            **common, "model.name": "mlp", "data.name": "digits", "model.hidden": "512,512",
            "train.batch_size": "64"},
        "gpt L=4 d=128 s=128 (char, b=16)": {
            **common, "model.name": "gpt", "data.name": "tinyshakespeare",
            "data.dir": str(Path(data_dir) / "tinyshakespeare"), "model.n_layer": "4",
            "model.d_model": "128", "model.n_head": "4", "data.seq_len": "128",
            "data.limit_train": "20000", "data.limit_test": "500", "train.batch_size": "16"},
    }


def _runs(comm: Any, runs: dict[str, dict[str, str]]) -> dict[str, tuple[Any, ...]]:
    from thinwire import config
    from thinwire.builders import build_model, build_strategy, load_data, make_stream
    from thinwire.data.task import task_for
    from thinwire.planner.runs import predict_dp_run
    from thinwire.runtime.comm import Comm

    out = {}
    for name, over in runs.items():
        cfg = config.load(None, over)
        ds = load_data(cfg)
        predicted = predict_dp_run(cfg, ds, build_model(cfg, ds))
        own = Comm()
        strategy = build_strategy(cfg, own, torch.device("cpu"), task_for(ds),
                                  build_model(cfg, ds))
        stream = make_stream(cfg, ds, *strategy.data_shard())
        for t in range(cfg.train.steps):
            strategy.train_step(stream.batch(t), t)
        mem = strategy.memory()
        sent = own.ledger.totals()["sent_bytes"]
        strategy.close()
        out[name] = (predicted[0], predicted[1].sent[own.rank], mem, sent)
    return out


def kb(b: float) -> str:
    return f"{b / 1024:.1f}"


def main() -> None:
    from thinwire.errors import UsageError
    from thinwire.runtime.spawn import run_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from thinwire.data.text import BUNDLED_DIR

    parser.add_argument("--data-dir", default=str(BUNDLED_DIR),
                        help="directory holding tinyshakespeare/ (default: the package's copy)")
    args = parser.parse_args()
    print("| model | memory options | states KiB pred / meas | activations KiB pred / meas "
          "| gathered KiB pred / meas | peak KiB pred / meas | error | sent/rank KiB pred / "
          "ledger |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model, base in models(args.data_dir).items():
        runs = {}
        for name, extra in OPTIONS.items():
            over = {**base, **extra}
            try:
                from thinwire import config

                config.load(None, over)
            except UsageError as exc:
                print(f"| {model} | {name} | not offered: {exc} ||||||")
                continue
            runs[name] = over
        ranks = run_group(_runs, 2, runs, timeout=600, threads=1)
        for name in runs:
            pred = ranks[0][name][0]
            meas = [r[name][2] for r in ranks]
            states = max(m.total for m in meas)
            acts = max(m.activations for m in meas)
            gathered = max(m.gathered for m in meas)
            peak = max(m.peak for m in meas)
            sent_pred = max(r[name][1] for r in ranks)
            sent = max(r[name][3] for r in ranks)
            p_states = pred.params + pred.grads + pred.optimizer
            err = (pred.peak - peak) / peak
            print(f"| {model} | {name} | {kb(p_states)} / {kb(states)} | "
                  f"{kb(pred.activations)} / {kb(acts)} | {kb(pred.gathered)} / {kb(gathered)} | "
                  f"{kb(pred.peak)} / {kb(peak)} | {err:+.2%} | {kb(sent_pred)} / {kb(sent)} |")


if __name__ == "__main__":
    main()
