"""Tasks: the loss a dataset is trained with and the metric it is judged by.

The task follows from the dataset's kind (:data:`~thinwire.data.datasets.KINDS`); methods never
know it, they call :meth:`Task.loss` on the model's output:
- ``classification`` and ``node``: cross-entropy on the class logits; metric test accuracy
  (higher is better), with the mean negative log-likelihood beside it;
- ``sequence`` (next-token language modelling): cross-entropy over every position of
  [B, L, V] logits; metric validation perplexity exp(mean NLL per token) (lower is better);
- ``click`` (click-through prediction): binary cross-entropy on one logit per example; metric
  test AUC (the probability that a random click scores above a random non-click, ties counted
  half; higher is better), with the log loss as ``nll`` and the accuracy at 0.5 beside it;
- ``extreme`` (extreme multi-label classification): softmax cross-entropy against the uniform
  distribution over the example's labels (y [N, Y] padded with -1); metric precision@1 (the
  fraction of the top-scored labels that are true), with precision@5 and the NLL beside it.

:meth:`Task.evaluate` returns ``{"metric": name, name: value, "nll": mean NLL, ...}``; for
classification the accuracy is under ``"accuracy"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.data.datasets import Dataset

EVAL_LOGITS = 1 << 26
"""The most logits an evaluation batch holds at once (256 MiB of float32)."""


def eval_rows(num_classes: int, most: int = 1000) -> int:
    """Rows of an evaluation batch: ``most``, fewer where ``num_classes`` logits a row would hold
    more than :data:`EVAL_LOGITS` at once (a 1,000,000-label layer: 67 rows, not 4 GB of
    logits). The same for every width up to 67,108 labels."""
    return max(1, min(most, EVAL_LOGITS // max(num_classes, 1)))


@dataclass(frozen=True)
class Task:
    """Loss and metric of one dataset kind."""

    kind: str
    metric: str
    """Name of the metric in evaluation records (``accuracy`` or ``perplexity``)."""
    higher_is_better: bool

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss: mean cross-entropy over examples (and positions)."""
        if self.kind == "sequence":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(),
                                   target.reshape(-1))
        if self.kind == "click":
            return F.binary_cross_entropy_with_logits(output.reshape(-1).float(),
                                                      target.reshape(-1).float())
        if self.kind == "extreme":
            return multilabel_nll(output.float(), target, reduction="mean")
        return F.cross_entropy(output.float(), target)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                 device: torch.device | None = None, batch_size: int = 1000) -> dict[str, float]:
        """The metric and the mean NLL of ``model`` on (x, y), in eval mode (restored after)."""
        if self.kind == "click":
            return self._evaluate_clicks(model, x, y, device=device, batch_size=batch_size)
        if self.kind == "extreme":
            return self._evaluate_extreme(model, x, y, device=device, batch_size=batch_size)
        was_training = model.training
        model.eval()
        nll, correct, count = 0.0, 0, 0
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            if device is not None:
                xb, yb = xb.to(device), yb.to(device)
            out = model(xb).float()
            if self.kind == "sequence":
                out = out.reshape(-1, out.shape[-1])
                yb = yb.reshape(-1)
            nll += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(-1) == yb).sum())
            count += yb.numel()
        model.train(was_training)
        mean_nll = nll / max(count, 1) if math.isfinite(nll) else float("inf")
        out_d: dict[str, float] = {"nll": mean_nll, "accuracy": correct / max(count, 1)}
        if self.kind == "sequence":
            out_d["perplexity"] = math.exp(mean_nll) if mean_nll < 700 else float("inf")
        return out_d

    @torch.no_grad()
    def _evaluate_clicks(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                         device: torch.device | None, batch_size: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        scores = []
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size]
            scores.append(model(xb.to(device) if device is not None else xb).reshape(-1)
                          .float().cpu())
        model.train(was_training)
        s = torch.cat(scores)
        t = y.reshape(-1).float().cpu()
        nll = float(F.binary_cross_entropy_with_logits(s, t))
        return {"auc": auc(s, t), "nll": nll, "accuracy": float(((s > 0).float() == t)
                                                                .float().mean())}

    @torch.no_grad()
    def _evaluate_extreme(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                          device: torch.device | None, batch_size: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        nll, hits, count = 0.0, {1: 0.0, 5: 0.0}, 0
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            if device is not None:
                xb, yb = xb.to(device), yb.to(device)
            out = model(xb).float()
            nll += float(multilabel_nll(out, yb, reduction="sum"))
            for k in hits:
                hits[k] += float(precision_at(out, yb, k).sum())
            count += len(xb)
        model.train(was_training)
        n = max(count, 1)
        # accuracy: the top label is one of the example's labels (precision@1 itself)
        return {"precision@1": hits[1] / n, "precision@5": hits[5] / n, "nll": nll / n,
                "accuracy": hits[1] / n}

    def better(self, a: float, b: float) -> bool:
        """Whether metric value ``a`` is better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def reached(self, value: float, target: float) -> bool:
        """Whether a metric value meets a target (>= for accuracy, <= for perplexity)."""
        return value >= target if self.higher_is_better else value <= target


def multilabel_nll(logits: torch.Tensor, labels: torch.Tensor, *, reduction: str = "mean"
                   ) -> torch.Tensor:
    """-sum_{l in labels} log softmax(logits)_l / |labels| per example (labels [B, Y] padded
    with -1), averaged or summed over the batch."""
    logp = torch.log_softmax(logits, dim=-1)
    valid = labels >= 0
    picked = logp.gather(1, labels.clamp(min=0)) * valid
    per = -picked.sum(1) / valid.sum(1).clamp(min=1)
    return per.mean() if reduction == "mean" else per.sum()


def precision_at(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Per example: the fraction of the k top-scored labels that are true (labels [B, Y]
    padded with -1)."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    hit = (top.unsqueeze(-1) == labels.unsqueeze(1)) & (labels.unsqueeze(1) >= 0)
    return hit.any(-1).float().sum(1) / k


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels``: the Mann-Whitney statistic
    from the ranks of the scores (ties get their mean rank); 0.5 when one class is absent."""
    s = scores.double().reshape(-1)
    pos = labels.reshape(-1) > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    sorted_s = s[order]
    # mean rank (1-based) of each run of equal scores
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True,
                                                  return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


TASKS: dict[str, Task] = {
    "classification": Task("classification", "accuracy", True),
    "node": Task("node", "accuracy", True),
    "sequence": Task("sequence", "perplexity", False),
    "click": Task("click", "auc", True),
    "extreme": Task("extreme", "precision@1", True),
}


def task_for(dataset: Dataset) -> Task:
    """The task of ``dataset``'s kind."""
    return TASKS[dataset.kind]
