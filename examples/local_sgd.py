"""Local SGD and DiLoCo around your model and optimizers (the shape torchft users know).

    torchrun --nproc-per-node 2 examples/local_sgd.py --steps 200
    torchrun --nproc-per-node 2 examples/local_sgd.py --steps 200 --diloco
"""

import sys

import torch
from common import arguments, batches, diabetes, net, report, setup, teardown
from torch import nn

import thinwire


def main() -> None:
    diloco = "--diloco" in sys.argv
    if diloco:
        sys.argv.remove("--diloco")
    args = arguments()
    rank, world = setup()
    x, y, x_test, y_test = diabetes(rank, world)
    model = net()
    comm = thinwire.Comm()
    if diloco:
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr / 10)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        wrapper = thinwire.DiLoCo(model, inner, outer, sync_every=20, comm=comm)
        optimizer = inner
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        wrapper = thinwire.LocalSGD(model, optimizer, sync_every=10, comm=comm)
    with wrapper:
        for step in range(args.steps):
            xb, yb = batches(x, y, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()   # every sync_every-th step averages the replicas
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(model.eval()(x_test), y_test))
    report(rank, "diloco" if diloco else "localsgd", mse, comm.ledger.totals()["sent_bytes"])
    teardown()


if __name__ == "__main__":
    main()
