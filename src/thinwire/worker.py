"""The worker entry: ``python -m thinwire.worker RUN_DIR/config.toml``.

``thinwire train`` starts it through torch's elastic launcher; on several machines start it with
an external torchrun, for example on each of 2 nodes::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id myrun -m thinwire.worker runs/dp/config.toml

The run directory is the folder holding the config file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from thinwire import config as config_mod
from thinwire.errors import UsageError
from thinwire.runtime import dist as rt
from thinwire.runtime.comm import Comm
from thinwire.trainer import Trainer


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m thinwire.worker RUN_DIR/config.toml", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        cfg = config_mod.load(path)
        device = rt.init_from_env(cfg.runtime)
    except UsageError as exc:
        print(f"thinwire worker: error: {exc}", file=sys.stderr)
        return 2
    comm = Comm() if rt.initialised() else Comm.local()
    try:
        trainer = Trainer(cfg, comm, device, path.parent)
        trainer.run()
    except UsageError as exc:
        print(f"thinwire worker: error: {exc}", file=sys.stderr)
        return 2
    del trainer
    rt.teardown(comm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
