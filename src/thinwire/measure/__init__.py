"""Measuring thinwire on this machine: calibration, and the predictor of thinwire's own runs.

Beside the testbed (which measures bytes on tc-limited links), this package measures time:

- :mod:`.predict`: a run config's ledger bytes, exactly, from its method's own traffic function
  over the layout of the run's model, and its step time from calibrated constants;
- :mod:`.calibrate`: the constants, measured under the runs' own process layout (compute rate
  and per-step overhead, links, DDP's per-bucket cost, codecs, straggler factors) and fitted;
  :mod:`.probes`: the measurements, run in every process of a forked group at once;
- :mod:`.local`: a run's local work on a communicator that moves nothing (what a worker
  trains, its per-synchronisation work);
- :mod:`.suite`: ``thinwire plan --calibrate``: calibrate, run every method here, calibrate
  again, and report predicted against measured.

Unlike :mod:`thinwire.planner` (pure functions of specs) this package builds models and
processes; it names no method (everything comes through :data:`thinwire.strategies.METHODS`).
"""

from thinwire.measure.calibrate import Calibration, LinkFit, calibrate, fit_alpha_beta
from thinwire.measure.local import RunShape, Silent, run_shape
from thinwire.measure.predict import predict_run, run_layout, run_traffic, summary_bytes
from thinwire.measure.probes import Probe
from thinwire.measure.suite import calibration_report, run_suite, suite_configs

__all__ = [
    "Calibration",
    "LinkFit",
    "Probe",
    "RunShape",
    "Silent",
    "calibrate",
    "calibration_report",
    "fit_alpha_beta",
    "predict_run",
    "run_layout",
    "run_shape",
    "run_suite",
    "run_traffic",
    "suite_configs",
    "summary_bytes",
]
