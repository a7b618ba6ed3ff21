"""Orthogonal rotations for the KV cache (METHOD.md, "The objective").

Conventions used everywhere in the project:

* Rows are rotated on the right: ``x' = x @ R`` with ``x[..., d]``.
* ``R = U @ H @ P``: ``U`` an eigenbasis (columns sorted by descending
  eigenvalue), ``H`` the normalised Hadamard matrix, ``P`` the bit-reversal
  permutation matrix with ``(x @ P)[..., j] = x[..., perm[j]]``.
* Per-KV-head rotations are stacked ``[kv_heads, d, d]``; query head ``h``
  of ``q_heads`` uses KV head ``h // (q_heads // kv_heads)`` (the grouping of
  transformers' ``repeat_kv`` and SGLang's GQA kernels).

Construction is done in float64; callers cast to what they store.
"""

from __future__ import annotations

import math

import torch


def _check_power_of_two(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard and bit-reversal need a power-of-two dimension, got {d}")


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``H`` (``H @ H.T = I``, symmetric)."""
    _check_power_of_two(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(dtype)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """Indices ``perm`` with ``perm[j]`` = ``j`` with its ``log2(d)`` bits reversed."""
    _check_power_of_two(d)
    bits = d.bit_length() - 1
    j = torch.arange(d)
    out = torch.zeros_like(j)
    for b in range(bits):
        out |= ((j >> b) & 1) << (bits - 1 - b)
    return out


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Matrix ``P`` with ``(x @ P)[..., j] = x[..., perm[j]]``."""
    d = perm.numel()
    p = torch.zeros(d, d, dtype=dtype)
    p[perm, torch.arange(d)] = 1
    return p


def eigenbasis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric matrix in float64, sorted by descending eigenvalue.

    Returns ``(eigenvalues[d], U[d, d])`` with ``cov ≈ U diag(λ) U^T``.  Sign
    convention (deterministic): each column's entry of largest magnitude is
    positive (the first such entry on ties).  Works batched over leading dims.
    """
    c = cov.to(torch.float64)
    c = (c + c.transpose(-1, -2)) * 0.5
    if not torch.isfinite(c).all():
        raise ValueError("covariance has non-finite entries")
    vals, vecs = torch.linalg.eigh(c)
    vals = vals.flip(-1)
    vecs = vecs.flip(-1)
    pivot = vecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(vecs, -2, pivot))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return vals, vecs * sign


def compose(u: torch.Tensor | None, d: int | None = None, *, use_hadamard: bool = True,
            use_permutation: bool = True) -> torch.Tensor:
    """``R = U @ H @ P`` (float64).  ``u=None`` means ``U = I`` (needs ``d``); batched over ``u``'s leading dims."""
    if u is None:
        if d is None:
            raise ValueError("compose needs either U or the dimension d")
        u = torch.eye(d, dtype=torch.float64)
    u = u.to(torch.float64)
    d = u.shape[-1]
    r = u
    if use_hadamard:
        r = r @ hadamard(d)
    if use_permutation:
        r = r[..., bit_reversal_permutation(d)]  # right-multiplying by P permutes columns
    return r


def orthogonality_error(r: torch.Tensor) -> torch.Tensor:
    """``max |R^T R - I|`` per matrix (leading dims kept), computed in float64."""
    r = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return (r.transpose(-1, -2) @ r - eye).abs().amax(dim=(-1, -2))


def nearest_orthogonal(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix closest to ``m`` in Frobenius norm (polar factor ``U Vᵀ``), float64, batched."""
    u, _, vh = torch.linalg.svd(m.to(torch.float64))
    return u @ vh


def group_index(q_heads: int, kv_heads: int, device=None) -> torch.Tensor:
    """KV head used by each query head: ``h // (q_heads // kv_heads)``."""
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} KV heads")
    return torch.arange(q_heads, device=device) // (q_heads // kv_heads)


def rotate_kv(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Write-path rotation ``(x - mean) @ R`` per KV head.

    ``x[..., kv_heads, d]``, ``rotation[kv_heads, d, d]``, ``mean[kv_heads, d]`` or None.
    Computed in float32 (float64 if ``x`` is float64); returns that dtype.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    if mean is not None:
        xf = xf - mean.to(work)
    return torch.einsum("...hd,hde->...he", xf, rotation.to(work))


def _grouped(x: torch.Tensor, rotation: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x[..., q_heads, d] @ R[group(h)]`` (``R^T`` if ``transpose``) as one matmul per KV head group.

    The query heads of a group are contiguous (``group_index``), so ``x`` is
    viewed as ``[rows, kv_heads, group, d]`` against ``R[kv_heads, d, d]``: no
    ``[q_heads, d, d]`` gather.  float32 (float64 if ``x`` is float64).

    An ``einsum``, i.e. one batched matmul over the KV heads (``[kv_heads,
    rows x group, d] @ R``).  Not ``torch.matmul(x.view(..., kv, g, d), R)``:
    its batch dims broadcast, and matmul materialises ``R`` expanded to every
    row (``rows x kv_heads x d x d``: 4 GiB for an 8k-token prefill chunk of
    8 KV heads at d 128) and runs ``rows x kv_heads`` tiny matmuls; on a 2-core
    CPU 2048 tokens of 32 heads at d 128 took 680 ms that way, 85 ms this way.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    *lead, hq, d = x.shape
    kv = rotation.shape[0]
    if kv <= 0 or hq % kv:
        raise ValueError(f"{hq} query heads cannot be grouped over {kv} KV heads")
    r = rotation.to(work)
    if transpose:
        r = r.transpose(-1, -2)
    xg = x.to(work).reshape(math.prod(lead), kv, hq // kv, d)
    return torch.einsum("nkgd,kde->nkge", xg, r).reshape(*lead, hq, d)


def rotate_queries(q: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Read-path query rotation ``q @ R_K[group(h)]`` for ``q[..., q_heads, d]`` (references and Triton glue)."""
    return _grouped(q, rotation, transpose=False)


def derotate_output(o: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Read-path output de-rotation ``o' @ R_V[group(h)]^T`` for ``o[..., q_heads, d]``."""
    return _grouped(o, rotation, transpose=True)


def unrotate_kv(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`rotate_kv`: ``x' @ R^T + mean`` (for error reports, never for serving)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.einsum("...he,hde->...hd", x.to(work), rotation.to(work))
    if mean is not None:
        out = out + mean.to(work)
    return out
