"""Batched truncated SVD of short, wide matrices through the Gram matrix (PuzzleKV §3.3).

For a page ``X [P, d]`` with ``P <= d``, the eigenvectors of ``G = X Xᵀ [P, P]`` are the left singular
vectors of ``X`` and its eigenvalues the squared singular values. Taking ``L = Q_r`` (top-r
eigenvectors) and ``R = Q_rᵀ X`` gives exactly the rank-r truncated SVD ``X_r = U_r Σ_r W_rᵀ``
(``R = Σ_r W_rᵀ``). One batched ``eigh`` of P×P matrices replaces one SVD per page.
"""

from __future__ import annotations

import torch


def gram_eigh_factors(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-``rank`` truncated SVD factors of a batch of matrices via their Gram matrices.

    Args:
        x: ``[..., P, d]`` float tensor (computed in fp32, or fp64 if given fp64).
        rank: number of components kept, ``1 <= rank <= min(P, d)``.

    Returns:
        ``(L, R, sigma)``: ``L [..., P, rank]`` orthonormal columns (top eigenvectors, descending;
        contiguous),
        ``R [..., rank, d] = Lᵀ x``, and ``sigma [..., rank]`` the singular values (descending), so
        that ``L @ R`` is the best rank-``rank`` approximation of ``x`` in Frobenius norm.
    """
    n_rows, n_cols = x.shape[-2], x.shape[-1]
    if not 1 <= rank <= min(n_rows, n_cols):
        raise ValueError(f"rank must be in [1, min(P, d)] = [1, {min(n_rows, n_cols)}], got {rank}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(dt)
    gram = xf @ xf.transpose(-1, -2)
    # eigh returns ascending eigenvalues; the top-r components are the last r columns, reversed.
    evals, evecs = torch.linalg.eigh(gram)
    # eigh's eigenvectors are column-major (LAPACK); L is stored, so make it row-major once here
    # (a strided L made the Triton launcher copy every layer's L factors on every decode step).
    left = evecs[..., -rank:].flip(-1).contiguous()
    sigma = evals[..., -rank:].flip(-1).clamp_min(0).sqrt()
    right = left.transpose(-1, -2) @ xf
    return left, right, sigma


def randomized_svd(a: torch.Tensor, q: int, niter: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U [m, q], S [q], V [n, q])`` of ``a [m, n]`` by randomized SVD (Halko et al. 2009, Alg. 5.1
    with ``niter`` power iterations), the test matrix drawn from ``generator`` (CPU) so that the
    global RNG is never touched. The same steps as ``torch.svd_lowrank``, which draws from the global
    RNG: with a generator seeded as the global one was, the result is the same."""
    tall = a.shape[0] >= a.shape[1]
    x = a if tall else a.mH
    r = torch.randn(x.shape[1], q, dtype=x.dtype, generator=generator).to(x.device)
    basis = torch.linalg.qr(x @ r).Q
    for _ in range(niter):
        basis = torch.linalg.qr(x.mH @ basis).Q
        basis = torch.linalg.qr(x @ basis).Q
    u, s, vh = torch.linalg.svd(basis.mH @ x, full_matrices=False)
    u, v = basis @ u, vh.mH
    return (u, s, v) if tall else (v, s, u)
