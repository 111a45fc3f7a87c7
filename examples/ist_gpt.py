"""IST of a transformer in your own training loop: thinwire's GPT with its adapter (attention
heads and FFN neurons dealt to workers each round; embeddings, norms and the head averaged),
your optimizer, loss and schedule.

    torchrun --nproc-per-node 2 examples/ist_gpt.py --steps 200 [--text FILE]

The text is ``--text``, else tiny-shakespeare where thinwire finds it, else this file's own
source; characters are the tokens. Each rank draws its own windows of the first 90 % (seeded by
rank and step); the validation loss is on the last 10 %.
"""

import argparse
import gc
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import thinwire
from thinwire.data.text import find_tinyshakespeare
from thinwire.models.gpt import GPT

CONTEXT = 32


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text", default="")
    return p.parse_args()


def corpus(path: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, validation ids, vocabulary size) of the text, 200k characters at most."""
    found = Path(path) if path else find_tinyshakespeare() or Path(__file__)
    text = found.read_text()[:200_000]
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(vocab)


def windows(ids: torch.Tensor, gen: torch.Generator, size: int = 16
            ) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(ids) - CONTEXT - 1, (size,), generator=gen)
    rows = start[:, None] + torch.arange(CONTEXT + 1)
    return ids[rows[:, :-1]], ids[rows[:, 1:]]


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    train, val, vocab = corpus(args.text)
    torch.manual_seed(0)  # the same model on every rank
    model = GPT(vocab, CONTEXT, n_layer=2, n_head=4, d_model=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    comm = thinwire.Comm()
    # heads and FFN neurons cut into world-size disjoint subnets every 10 steps; inside a
    # subnet the attention and FFN outputs are scaled up by units / held (inverted dropout)
    ist = thinwire.IST(model, optimizer, comm=comm, local_steps=10, adapter=thinwire.GPTAdapter(model))
    for step in range(args.steps):
        x, y = windows(train, torch.Generator().manual_seed(100_003 * rank + step))
        optimizer.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()  # every 10th step ends a round: the subnets go home
        schedule.step()
    full = ist.full_model()  # at a round boundary: the whole model on rank 0
    if full is not None:
        x, y = windows(val, torch.Generator().manual_seed(1), size=256)
        with torch.no_grad():
            loss = float(F.cross_entropy(full.eval()(x).flatten(0, 1), y.flatten()))
        print(f"ist gpt: final validation loss {loss:.4f} (uniform: {math.log(vocab):.4f}), "
              f"sent {comm.ledger.totals()['sent_bytes']:.0f} bytes", flush=True)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
