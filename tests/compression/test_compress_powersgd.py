"""PowerSGD's rank-r approximation: error falls with the rank and with warm-started iterations."""

from collections.abc import Callable

import torch

from thinwire.compression import PowerSGD
from thinwire.runtime.comm import Comm


def _matrix(decay: Callable[[torch.Tensor], torch.Tensor], n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """U diag(sigma) V^T with random orthogonal U, V and the given singular values."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    sigma = decay(torch.arange(n, dtype=torch.float32))
    return u @ torch.diag(sigma) @ v.T, sigma


def _error(comp: PowerSGD, m: torch.Tensor, step: int) -> float:
    x = m.reshape(-1)  # 64 x 64: the near-square reshape is the matrix itself
    return float((comp.decode(comp.encode(x, step), x.numel(), step) - x).norm())


def test_error_decreases_with_rank() -> None:
    """Guards the rank-r approximation: error falls with r, never beats the truncated SVD."""
    m, sigma = _matrix(lambda j: 0.5 ** j)
    errors = [_error(PowerSGD(r, seed=1), m, 0) for r in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    # never better than the truncated SVD (Eckart-Young), and close to it at rank 8
    for r, e in zip((1, 2, 4, 8), errors):
        assert e >= float(sigma[r:].norm()) * (1 - 1e-4)
    assert errors[-1] < 0.05


def test_error_decreases_with_warm_start_iterations() -> None:
    """Guards the warm start (step 7): repeated steps are subspace iteration and approach the
    best rank-2 error; cold starts do not."""
    # slow spectral decay (sigma_j = 1 / (j + 1)): one power iteration is far from the best
    m, sigma = _matrix(lambda j: 1 / (j + 1))
    best = float(sigma[2:].norm())
    warm = PowerSGD(2, seed=1)
    errors = [_error(warm, m, t) for t in range(10)]
    assert all(b <= a + 1e-5 for a, b in zip(errors, errors[1:]))  # subspace iteration
    assert errors[0] > 1.2 * best and errors[-1] < 1.01 * best
    cold = PowerSGD(2, seed=1, warm_start=False)  # a fresh random Q each step never converges
    assert min(_error(cold, m, t) for t in range(10)) > 1.1 * best


def test_layout_compresses_matrices_and_sends_vectors_raw() -> None:
    """Guards the bucket layout and its traffic description: matrices compressed, vectors and
    tiny matrices sent raw, the two all-reduces' bytes exactly."""
    comp = PowerSGD(2)
    shapes = [(16, 8), (16,), (4, 16), (4,), (2, 2)]  # (2, 2): r (n + m) = 8 >= 4, raw
    numel = 128 + 16 + 64 + 4 + 4
    segs = comp.layout(numel, shapes)
    assert [nm for _, _, nm in segs] == [(16, 8), None, (4, 16), None, None]
    assert comp.collectives(numel, shapes) == [("all_reduce", 4 * (2 * 16 + 16 + 2 * 4 + 4 + 4)),
                                               ("all_reduce", 4 * (2 * 8 + 2 * 16))]
    assert comp.exchange_bytes(numel, shapes) == 4 * (2 * 24 + 16 + 2 * 20 + 4 + 4)
    # a flat tensor of the planner: near-square 32 x 32 for 1000 elements (zero-padded)
    assert comp.payload_bytes(1000) == 4 * 2 * (32 + 32)


def test_single_rank_average_is_the_projection_with_error_feedback() -> None:
    """Guards steps 0-8 at world size 1: the average is the rank-2 projection, the residual is
    exactly what it left out, and the next step projects input plus residual on the warm Q."""
    m, _ = _matrix(lambda j: 0.5 ** j, n=16)
    comp = PowerSGD(2, seed=1)
    comm = Comm.local()  # world size 1: no process group, the collectives are local no-ops
    fut, sent = comp.average_async(comm, m.reshape(-1).clone(), 0, shapes=[(16, 16)])
    out = fut.wait().view(16, 16)
    assert sent == 4 * 2 * (16 + 16)
    assert torch.linalg.matrix_rank(out) == 2
    # step 8: the residual is exactly what the approximation left out
    e = comp.residuals[0].view(16, 16).clone()
    assert torch.allclose(e + out, m, atol=1e-6)
    # step 0 next time: a zero gradient sends the residual's projection on span(M Q_warm)
    q_warm = comp.qs[(0, 0)].clone()
    fut, _ = comp.average_async(comm, torch.zeros(256), 1, shapes=[(16, 16)])
    got = fut.wait().view(16, 16)
    p_hat = torch.linalg.qr(e @ q_warm).Q
    assert torch.allclose(got, p_hat @ p_hat.T @ e, atol=1e-6)
    assert torch.allclose(got + comp.residuals[0].view(16, 16), e, atol=1e-6)  # nothing lost
