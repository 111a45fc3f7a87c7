"""IST in your own training loop: your model, optimizer, loss and schedule; thinwire decides only
which subnet each worker trains, what travels and when.

    torchrun --nproc-per-node 2 examples/ist_regression.py --steps 200
"""

import torch
from common import arguments, batches, diabetes, net, report, setup, teardown
from torch import nn

import thinwire


def main() -> None:
    args = arguments()
    rank, world = setup()
    x, y, x_test, y_test = diabetes(rank, world)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    comm = thinwire.Comm()
    # the hidden layers of the Sequential are found and cut into `world` disjoint subnets;
    # inverted-dropout scaling keeps a subnet's activations on the full model's scale
    ist = thinwire.IST(model, optimizer, comm=comm, local_steps=10, scale="dropout")
    for step in range(args.steps):
        xb, yb = batches(x, y, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()   # every 10th step ends a round: the subnets go home
        schedule.step()
    full = ist.full_model()  # at a round boundary: the whole model on rank 0
    if full is not None:
        with torch.no_grad():
            mse = float(nn.functional.mse_loss(full.eval()(x_test), y_test))
        report(rank, "ist", mse, comm.ledger.totals()["sent_bytes"])
    teardown()


if __name__ == "__main__":
    main()
