"""A gradient codec as a DDP communication hook, in your own loop: PowerSGD rank 2 (or any codec:
``--codec topk:ratio=0.05``), error feedback on where the codec is biased, every byte counted.

    torchrun --nproc-per-node 2 examples/compressed_ddp.py --codec powersgd:rank=2
"""

import sys

import torch
from common import arguments, batches, diabetes, net, report, setup, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire


def main() -> None:
    codec = "powersgd:rank=2"
    if "--codec" in sys.argv:
        i = sys.argv.index("--codec")
        codec = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    args = arguments()
    rank, world = setup()
    x, y, x_test, y_test = diabetes(rank, world)
    model = DDP(net())
    state = thinwire.register_codec(model, codec)  # thinwire.Comm() on the default group
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        xb, yb = batches(x, y, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(model.module.eval()(x_test), y_test))
    report(rank, f"ddp+{codec}", mse, state.comm.ledger.totals()["sent_bytes"])
    del model, optimizer
    teardown()


if __name__ == "__main__":
    main()
