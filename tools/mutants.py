"""Planted-bug mutation testing: does the test suite notice a realistic bug?

Each mutant below is one small, realistic bug in the communication layer, the byte ledger,
IST's exchange, the codecs, checkpointing, the data path or the command line. For each one:
  1. copy ``src/``, ``tests/`` and ``pyproject.toml`` into ``.mutants/<id>/`` (inside the
     repository, so the tests find ``../shared/data`` as they do in a checkout);
  2. replace the mutant's original text (which must occur exactly once) with the bug;
  3. run the tests that guard that code (``pytest -x``, the copy's ``src`` first on the path);
  4. killed: the tests failed; survived: they passed (a gap in the tests); timeout: they ran
     past ``--timeout`` (counted apart).
The copy is removed afterwards. A mutant that no longer applies (the code moved) is reported
as ``stale``: update its text here. Equivalent mutants (a bug another check already stops, such
as accepting the run name ``..``, which the leading-dot rule refuses anyway) are left out.

    python tools/mutants.py                 # every mutant, a markdown table on stdout
    python tools/mutants.py --only ef-sign  # some of them
    python tools/mutants.py --check         # first confirm every selection passes unmutated

Why a script of planted bugs rather than mutmut or cosmic-ray: their operator mutants (one
token each, thousands of them) need hours on a 2-core machine against multi-process tests;
these are the bugs a person writes (a sum for an average, a lost state, a wrong shard), each
aimed at the tests that should catch it, so the whole run takes minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    what: str
    file: str  # under src/thinwire/
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    # --- communication layer and ledger ---------------------------------------------------------
    Mutant("comm-avg", "comm", "all_reduce(op='avg') divides by n - 1",
           "runtime/comm.py", "tensor.div_(self.world_size)",
           "tensor.div_(max(1, self.world_size - 1))", ("tests/runtime/test_comm_ledger.py",)),
    Mutant("ledger-ring", "ledger", "ring all-reduce charged (n-1)/n instead of 2(n-1)/n",
           "ring.py", "return 2 * (n - 1) / n",
           "return (n - 1) / n", ("tests/runtime/test_comm_ledger.py",)),
    Mutant("ledger-gather", "ledger", "all-gather charges its payload once, not n - 1 times",
           "ring.py", "return float(n - 1)",
           "return 1.0", ("tests/runtime/test_comm_ledger.py",)),
    Mutant("ledger-recv", "ledger", "recv records no received bytes",
           "runtime/comm.py", 'exact=(0, nbytes(t)), device=dev)',
           'exact=(0, 0), device=dev)',
           ("tests/runtime/test_comm_ledger.py",)),
    # --- codecs ---------------------------------------------------------------------------------
    Mutant("ef-sign", "codecs", "error feedback keeps decoded - corrected",
           "compression/feedback.py", "torch.sub(corrected, decoded, out=buf)",
           "torch.sub(decoded, corrected, out=buf)", ("tests/compression",)),
    Mutant("topk-k", "codecs", "top-k keeps floor(ratio d) - 1 elements",
           "compression/base.py", "math.ceil(ratio * numel - 1e-9)",
           "math.floor(ratio * numel) - 1", ("tests/compression",)),
    Mutant("powersgd-sum", "codecs", "PowerSGD sums Q over ranks instead of averaging",
           "compression/powersgd.py", "q_avg = q_sum / world", "q_avg = q_sum",
           ("tests/compression",)),
    Mutant("qsgd-scale", "codecs", "QSGD scales by s / (2 ||x||)",
           "compression/quantize.py", "65536.0 * self.levels / n",
           "65536.0 * self.levels / n / 2", ("tests/compression",)),
    Mutant("fp8-scale", "codecs", "fp8's scale is absmax / (FMAX / 2): the largest values "
           "overflow the format", "compression/fp8.py",
           "absmax_scaled(flat, self.chunk, self.fmax)",
           "absmax_scaled(flat, self.chunk, self.fmax / 2)", ("tests/compression",)),
    # --- IST ------------------------------------------------------------------------------------
    Mutant("ist-shared-sum", "ist", "shared tensors add every worker's update without / n",
           "strategies/ist/store.py", "alpha=1.0 / n)", "alpha=1.0)", ("tests/strategies/ist",)),
    Mutant("ist-same-partition", "ist", "the partition never changes from round to round",
           "strategies/ist/partition.py", "np.random.SeedSequence([seed, round_, layer])",
           "np.random.SeedSequence([seed, 0, layer])", ("tests/strategies/ist",)),
    Mutant("ist-no-scale", "ist", "inverted-dropout factor always 1",
           "strategies/ist/core.py", "factor = self.plan.group(group).size / len(",
           "factor = 1.0 or len(", ("tests/strategies/ist",)),
    # --- checkpointing and resume ---------------------------------------------------------------
    Mutant("ckpt-no-opt", "checkpoint", "the optimizer state is not restored on resume",
           "strategies/base.py", 'self.opt.load_state_dict(state["opt"])', "pass",
           ("tests/test_foundation.py::test_resume_equals_uninterrupted",)),
    Mutant("ckpt-prune-all", "checkpoint", "pruning removes the newest checkpoint too",
           "checkpoint.py", "for old in complete_steps(run_dir)[:-keep]:",
           "for old in complete_steps(run_dir):", ("tests/reliability/test_checkpoint_errors.py",
                                                  "tests/reliability/test_resume_cli.py")),
    Mutant("ckpt-codec", "checkpoint", "compressed DP does not restore its codec state",
           "strategies/data_parallel.py",
           'self.hook_state.restore(list(self.model.parameters()), state["codec"])',
           "pass", ("tests/test_foundation.py::test_resume_equals_uninterrupted",)),
    # --- data path and methods ------------------------------------------------------------------
    Mutant("shard-zero", "data", "every rank trains on shard 0",
           "builders.py", "shard_of(cfg, dataset, shard, shards)", "shard_of(cfg, dataset, 0, shards)",
           ("tests/test_foundation.py", "tests/test_run_layer.py")),
    Mutant("localsgd-phase", "methods", "local SGD averages one step late",
           "strategies/averaging.py", "if self.steps % self.sync_every == 0:",
           "if self.steps % self.sync_every == 1:", ("tests/test_foundation.py",)),
    Mutant("diloco-nesterov", "methods", "DiLoCo's outer step without Nesterov",
           "strategies/diloco.py", "nesterov=o.outer_momentum > 0", "nesterov=False",
           ("tests/compression/test_compress_diloco.py", "tests/test_core.py")),
    # --- command line and run directories -------------------------------------------------------
    Mutant("compare-split", "cli", "--methods splits a method's own options into methods",
           "run.py", 'out[-1] += "," + part', "out.append(part)",
           ("tests/test_run_layer.py", "tests/test_cli.py")),
    Mutant("rundir-hidden", "rundir", "hidden run names ('.x', thinwire's own) accepted",
           "rundir.py", 'if name.startswith("."):', 'if name.startswith(".."):',
           ("tests/reliability/test_rundir.py",)),
    # --- behaviours no test held before -----------------------------------------------------------
    Mutant("aqsgd-frozen", "pipeline", "AQ-SGD's per-sample history frozen after the first "
           "visit (both sides)", "compression/aqsgd.py",
           "self.history[k] = v.clone()", "self.history.setdefault(k, v.clone())",
           ("tests/reliability/test_guarded_behaviours.py",)),
    Mutant("dct-every", "methods", "hybrid DCT re-estimates its DP threshold every step, not "
           "every method.every", "strategies/hybrid.py",
           "if step % self.o.every == 0:", "if True:",
           ("tests/reliability/test_guarded_behaviours.py",)),
    Mutant("resist-no-scale", "IST", "ResIST's test-time 1/min(S, n) scaling of partitioned "
           "blocks dropped", "models/resnet.py",
           "block.branch_scale = 1.0 / min(len(blocks), n)", "block.branch_scale = 1.0",
           ("tests/reliability/test_guarded_behaviours.py",)),
    Mutant("dp-codec-rescale", "checkpoint", "compressed dp accepted for resume at another "
           "worker count", "strategies/data_parallel.py",
           'return options.compressor == "none"', "return True",
           ("tests/reliability/test_guarded_behaviours.py",)),
    # --- hard edges: constants and rules no test pinned before ------------------------------------
    Mutant("slide-padded-count", "slide", "SLIDE's loss divides a sample's label term by its "
           "padded label slots, not its labels", "strategies/slide/method.py",
           "cnt = (y_all >= 0).sum(1).clamp(min=1).float()",
           "cnt = torch.full((G,), float(y_all.shape[1]), device=h_all.device)",
           ("tests/reliability/test_planted_edges.py::"
            "test_slide_loss_divides_by_the_true_label_count_not_the_slots",)),
    Mutant("diloco-alpha-swap", "methods", "Streaming DiLoCo's merge gives the local copy "
           "1 - alpha and the synced one alpha", "strategies/diloco.py",
           "self.params[i].mul_(1 - self.alpha).add_(local[j], alpha=self.alpha)",
           "self.params[i].mul_(self.alpha).add_(local[j], alpha=1 - self.alpha)",
           ("tests/reliability/test_planted_edges.py::"
            "test_streaming_diloco_merges_alpha_of_the_local_copy",)),
    Mutant("diloco-shared-residual", "methods", "Streaming DiLoCo's fragments share one codec "
           "residual", "strategies/diloco.py",
           "delta, key, key=p, tag=self.tag,", "delta, key, key=0, tag=self.tag,",
           ("tests/reliability/test_planted_edges.py::"
            "test_each_fragment_keeps_its_own_codec_residual",)),
    Mutant("scatter-ef-twice", "codecs", "the scattered exchange re-encodes the mean with error "
           "feedback (overwriting the rank's own shard's residual)", "compression/scatter.py",
           "wire = to_bytes(self._plain.encode(mine, step, key=shard_key))",
           "wire = to_bytes(self.inner.encode(mine, step, key=shard_key))",
           ("tests/reliability/test_planted_edges.py::"
            "test_the_scattered_exchange_re_encodes_the_mean_without_error_feedback",)),
    Mutant("fp4-zero", "codecs", "fp4's zero threshold at 2^-8 of the scale, not 2^-7 (half the "
           "smallest step)", "compression/fp4.py", "BITS_MIN = 120 << 23",
           "BITS_MIN = 119 << 23",
           ("tests/reliability/test_planted_edges.py::"
            "test_fp4_rounds_to_zero_below_half_the_smallest_step",)),
    Mutant("graph-poison-lost", "IST", "the graph adapter's union of two channel groups drops "
           "the absorbed group's must-share mark", "models/graph/groups.py",
           "g.poisoned = g.poisoned or o.poisoned", "g.poisoned = g.poisoned",
           ("tests/reliability/test_planted_edges.py::"
            "test_a_residual_stream_with_one_uncuttable_consumer_is_never_cut",)),
    Mutant("device-first-only", "comm", "the device rule checks only the first tensor of a "
           "call", "runtime/comm.py",
           "for t in tensors:\n            if want is not None",
           "for t in tensors[:1]:\n            if want is not None",
           ("tests/reliability/test_planted_edges.py::"
            "test_the_device_rule_checks_every_tensor_of_a_call",)),
    Mutant("crossover-bisect", "planner", "the crossover bandwidth's bisection keeps the wrong "
           "half", "planner/insight.py",
           "a, b = (mid, b) if gain(math.exp(mid)) < 0 else (a, mid)",
           "a, b = (a, mid) if gain(math.exp(mid)) < 0 else (mid, b)",
           ("tests/reliability/test_planted_edges.py::"
            "test_the_crossover_bandwidth_is_where_the_penalised_times_meet",)),
    Mutant("tmp-follows-links", "checkpoint", "temporary files opened without O_EXCL and "
           "O_NOFOLLOW (a planted link written through)", "rundir.py",
           "flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC",
           "flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC",
           ("tests/reliability/test_hard_edges.py::"
            "test_checkpoint_writes_never_follow_a_link_planted_at_their_temporary_file",)),
    Mutant("final-not-verified", "checkpoint", "a resume calls a run complete when its final "
           "checkpoint is sealed, whatever its final write left", "checkpoint.py",
           "if steps is not None and step == steps and final_state_problem(run_dir, step):",
           "if False:", ("tests/reliability/test_hard_edges.py::"
                         "test_a_failed_final_write_is_redone_by_resume",)),
    Mutant("ist-optstate-zeros", "IST", "reindexed optimizer state travels as zeros (the bytes "
           "unchanged, the momentum lost every round)", "strategies/ist/optstate.py",
           "xs += [st[k] if k in st else torch.zeros_like(x) for k in self.keys]",
           "xs += [torch.zeros_like(x) for k in self.keys]",
           ("tests/strategies/ist/test_ist_mlp.py::test_reindexed_momentum_travels_with_the_subnet",)),
    Mutant("ist-overlap-sum", "IST", "an element two overlapping subnets trained ends at the sum "
           "of their copies, not their mean", "strategies/ist/store.py",
           "mean = total / holders.to(total.dtype)", "mean = total",
           ("tests/strategies/ist/test_ist_remedies.py::"
            "test_an_overlapped_unit_ends_at_the_mean_of_its_holders",)),
    Mutant("graph-gqa-ratio", "IST", "grouped-query attention's key/value heads are joined to "
           "their query heads without the ratio (a unit: one query head's width of k and v rows)",
           "models/graph/groups.py", "replace(u, inner=Fraction(u.inner) / ratio)",
           "replace(u, inner=Fraction(u.inner))",
           ("tests/strategies/ist/test_ist_zoo.py::test_each_model_is_cut_where_its_papers_cut_it",)),
    Mutant("graph-split-segments", "IST", "a fused projection split into q, k and v keeps one "
           "segment (its rows cut as if q alone)", "models/graph/groups.py",
           "replace(u, segments=u.segments * chunks)", "replace(u, segments=u.segments)",
           ("tests/strategies/ist/test_ist_zoo.py::test_each_model_is_cut_where_its_papers_cut_it",)),
    Mutant("graph-grouped-paths", "IST", "a grouped convolution's unit is one channel, not a "
           "whole path (its filters read channels a subnet does not hold)",
           "models/graph/rules.py", "g.base = math.lcm(g.base, span.numerator)",
           "g.base = math.lcm(g.base, 1)",
           ("tests/strategies/ist/test_ist_graph.py::test_grouped_convolutions_are_cut_by_whole_groups",)),
    Mutant("ist-first-forward-keywords", "IST", "the plan is derived from the first forward's "
           "positional arguments only (its keywords, an attention mask, dropped)",
           "strategies/ist/core.py", "self._setup(self._derived(tuple(args), kwargs))",
           "self._setup(self._derived(tuple(args)))",
           ("tests/strategies/ist/test_ist_zoo.py::"
            "test_bert_called_with_keywords_and_an_attention_mask_trains_under_ist",)),
    Mutant("ist-stream-cut", "IST", "the derived adapter cuts a residual stream it should keep "
           "whole (the old default)", "models/graph/derive.py",
           '(residual == "whole" and g.stream)', '(residual == "none" and g.stream)',
           ("tests/strategies/ist/test_ist_graph.py::test_derived_residual_stream_stays_whole_by_default",)),
    Mutant("ist-step-frozen", "IST", "dealt Adam state restarts every round from the first "
           "round's step count (bias correction of a young state on old moments)",
           "strategies/ist/optstate.py", "        if scalars:\n            self.scalars = scalars",
           "        if scalars and not self.scalars:\n            self.scalars = scalars",
           ("tests/strategies/ist/test_ist_remedies.py::"
            "test_dealt_state_carries_adams_step_count_across_rounds",)),
    Mutant("ist-outer-sign", "IST", "the outer step moves against its pseudo-gradient's "
           "descent direction", "strategies/ist/store.py", "after.sub_(lr * u - g)",
           "after.add_(lr * u - g)", ("tests/strategies/ist/test_ist_remedies.py::"
                                      "test_outer_step_is_nesterov_sgd_on_the_rounds_pseudo_gradient",)),
    Mutant("rebuild-buffers", "codecs", "rebuild_buckets' warm-up forward leaves its moved "
           "buffers (BatchNorm statistics) in the model", "compression/hooks.py",
           "b.copy_(kept)", "pass",
           ("tests/reliability/test_planted_edges.py::"
            "test_rebuild_buckets_warm_up_leaves_buffers_draws_and_codec_as_they_were",)),
    Mutant("rebuild-rng", "codecs", "rebuild_buckets' warm-up consumes the random stream "
           "(dropout's draws not put back)", "compression/hooks.py",
           "with torch.random.fork_rng(devices=[] if dev.type == \"cpu\" else [dev],",
           "with torch.random.fork_rng(enabled=False, devices=[] if dev.type == \"cpu\" "
           "else [dev],",
           ("tests/reliability/test_planted_edges.py::"
            "test_rebuild_buckets_warm_up_leaves_buffers_draws_and_codec_as_they_were",)),
    Mutant("ft-apply-dropped", "fault tolerance", "a step the quorum voted down is applied "
           "anyway", "strategies/fault.py", "if self.replica.commit() and mean is not None:",
           "if (self.replica.commit() or True) and mean is not None:",
           ("tests/reliability/test_fault_tolerance.py::"
            "test_worker_killed_and_one_joining",)),
    Mutant("ft-residual-copied", "fault tolerance", "a joining worker copies its peer's "
           "error-feedback residuals", "strategies/fault.py",
           'PER_RANK = ("residual.",)', 'PER_RANK = ("no-such-state.",)',
           ("tests/reliability/test_fault_tolerance.py::"
            "test_worker_killed_and_one_joining",)),
)


def run_one(m: Mutant, timeout: float, mutate: bool = True) -> tuple[str, float]:
    """Steps 1-4 for one mutant: (outcome, seconds)."""
    work = ROOT / ".mutants" / m.id
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns(
            "__pycache__", "*.egg-info"))
        shutil.copytree(ROOT / "tests", work / "tests",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
        target = work / "src" / "thinwire" / m.file
        text = target.read_text()
        if text.count(m.old) != 1 or not all(
                (work / t.partition("::")[0]).exists() for t in m.tests):
            return "stale", 0.0
        if mutate:
            target.write_text(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": str(work / "src")}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-m", "not gpu and not netns", *m.tests]
        start = time.perf_counter()
        try:
            rc = subprocess.run(cmd, cwd=work, env=env, capture_output=True,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start
        seconds = time.perf_counter() - start
        if not mutate:
            return ("passes" if rc == 0 else f"FAILS unmutated (rc {rc})"), seconds
        return ("survived" if rc == 0 else "killed"), seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
    ap.add_argument("--check", action="store_true", help="run each selection unmutated first")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.id:20} {m.area:11} {m.what}")
        return 0
    rows = []
    for m in chosen:
        if args.check:
            outcome, _ = run_one(m, args.timeout, mutate=False)
            if outcome != "passes":
                print(f"{m.id}: {outcome}", file=sys.stderr)
                return 1
        outcome, seconds = run_one(m, args.timeout)
        print(f"{m.id}: {outcome} ({seconds:.0f} s)", file=sys.stderr)
        rows.append((m, outcome, seconds))
    killed = sum(o == "killed" for _, o, _ in rows)
    print("| mutant | area | planted bug | guarded by | outcome |")
    print("|---|---|---|---|---|")
    for m, outcome, _ in rows:
        print(f"| `{m.id}` | {m.area} | {m.what} | {', '.join(m.tests)} | {outcome} |")
    print(f"\n{killed} of {len(rows)} killed; survival rate "
          f"{100 * (len(rows) - killed) / max(1, len(rows)):.0f}%")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
