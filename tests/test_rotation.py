"""Rotations against orthogonality and the math of METHOD.md."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_sglang import format as fmt
from oscar_sglang import rotation as rot


@pytest.mark.parametrize("d", [1, 2, 64, 128, 256])
def test_hadamard_is_orthogonal_and_symmetric(d):
    h = rot.hadamard(d)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    # Entries are +-1/sqrt(d): it spreads a single spike evenly over every channel.
    assert torch.allclose(h.abs(), torch.full_like(h, d**-0.5))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        rot.hadamard(96)
    with pytest.raises(ValueError, match="power-of-two"):
        rot.bit_reversal_permutation(48)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bit_reversal_is_a_permutation_and_an_involution(d):
    perm = rot.bit_reversal_permutation(d)
    assert sorted(perm.tolist()) == list(range(d))
    assert torch.equal(perm[perm], torch.arange(d))
    # Spot-check the definition: 1 -> d/2, 2 -> d/4, d-1 -> d-1.
    assert perm[1] == d // 2 and perm[2] == d // 4 and perm[d - 1] == d - 1
    p = rot.permutation_matrix(perm)
    x = torch.randn(3, d, dtype=torch.float64)
    assert torch.equal(x @ p, x[:, perm])


def _random_spd(d, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return a @ a.T / d + 1e-3 * torch.eye(d, dtype=torch.float64)


@pytest.mark.parametrize("d", [64, 128])
def test_eigenbasis_sorted_with_deterministic_sign(d):
    c = _random_spd(d, d)
    vals, u = rot.eigenbasis(c)
    assert (vals[:-1] >= vals[1:]).all()
    assert torch.allclose(u @ torch.diag(vals) @ u.T, c, atol=1e-10)
    assert torch.allclose(c @ u, u * vals, atol=1e-10)
    pivot = u.abs().argmax(0)
    assert (u[pivot, torch.arange(d)] > 0).all()
    # Whatever signs eigh returns, the convention fixes them: a basis built from
    # sign-flipped eigenvectors of the same matrix comes back identical.
    flipped = u * torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0).double()
    _, u2 = rot.eigenbasis(flipped @ torch.diag(vals) @ flipped.T)
    assert torch.allclose(u, u2, atol=1e-8)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_composed_rotation_is_orthogonal(d):
    _, u = rot.eigenbasis(_random_spd(d, 7))
    r = rot.compose(u)
    assert rot.orthogonality_error(r) < 1e-5
    assert rot.orthogonality_error(r.float()) < 1e-5
    # R = U H P, spelled out with explicit matrices.
    p = rot.permutation_matrix(rot.bit_reversal_permutation(d))
    assert torch.allclose(r, u @ rot.hadamard(d) @ p, atol=1e-12)
    assert torch.allclose(rot.compose(None, d, use_permutation=False), rot.hadamard(d))


def _stacked_rotations(kv, d, seed):
    return torch.stack([rot.compose(rot.eigenbasis(_random_spd(d, seed + g))[1]) for g in range(kv)]).float()


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (8, 8), (8, 1)])
def test_rotate_derotate_identity(q_heads, kv_heads):
    d = 64
    torch.manual_seed(0)
    r = _stacked_rotations(kv_heads, d, 11)
    mu = torch.randn(kv_heads, d)
    k = torch.randn(5, kv_heads, d)
    assert torch.allclose(rot.unrotate_kv(rot.rotate_kv(k, r, mu), r, mu), k, atol=1e-5)
    o = torch.randn(5, q_heads, d)
    # Output de-rotation is the inverse of rotating by the group's R_V.
    rotated = torch.einsum("nhd,hde->nhe", o, r[rot.group_index(q_heads, kv_heads)])
    assert torch.allclose(rot.derotate_output(rotated, r), o, atol=1e-5)


@pytest.mark.parametrize("lead", [(), (0,), (7,), (2, 3)])
def test_grouped_rotations_match_each_heads_own_matrix(lead):
    # rotate_queries / derotate_output against the per-head gather they avoid, for any leading shape.
    q_heads, kv_heads, d = 6, 2, 16
    torch.manual_seed(1)
    r = _stacked_rotations(kv_heads, d, 21).double()
    x = torch.randn(*lead, q_heads, d, dtype=torch.float64)
    per_head = r[rot.group_index(q_heads, kv_heads)]  # [q_heads, d, d]
    want = torch.einsum("...hd,hde->...he", x, per_head)
    want_t = torch.einsum("...he,hde->...hd", x, per_head)
    got, got_t = rot.rotate_queries(x, r), rot.derotate_output(x, r)
    assert got.shape == got_t.shape == x.shape and got.is_contiguous() and got_t.is_contiguous()
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(got_t, want_t, atol=1e-12)


class _LargestBuffer(TorchDispatchMode):
    """Bytes of the largest storage any op inside the block returns (views return their base's)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("fn", [rot.rotate_queries, rot.derotate_output])
def test_grouped_rotations_never_copy_the_matrices_per_token(fn):
    # torch.matmul over [tokens, kv, group, d] x R[kv, d, d] broadcasts R to every token and copies it
    # (tokens x kv x d x d: 16x the input here, 4 GiB for an 8k-token prefill chunk at d 128).
    x, r = torch.randn(64, 8, 64), _stacked_rotations(2, 64, 31)
    with _LargestBuffer() as seen:
        fn(x, r)
    assert seen.most <= x.untyped_storage().nbytes()


def _attention(q, k, v):
    """Plain GQA softmax attention: q[n, H, d], k/v[t, G, d] -> [n, H, d]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    p = torch.softmax(torch.einsum("nhd,thd->hnt", q, k) / q.shape[-1] ** 0.5, dim=-1)
    return torch.einsum("hnt,thd->nhd", p, v), p


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4)])
def test_attention_equivalence_with_rotation_and_key_centering(q_heads, kv_heads):
    d = 64
    torch.manual_seed(2)
    rk = _stacked_rotations(kv_heads, d, 100)
    rv = _stacked_rotations(kv_heads, d, 200)
    mu = 3 * torch.randn(kv_heads, d)
    q = torch.randn(6, q_heads, d, dtype=torch.float64)
    k = torch.randn(20, kv_heads, d, dtype=torch.float64) + mu.double()
    v = torch.randn(20, kv_heads, d, dtype=torch.float64)
    out, p = _attention(q, k, v)
    q_r = rot.rotate_queries(q, rk)
    k_r = rot.rotate_kv(k, rk, mu)
    v_r = rot.rotate_kv(v, rv)
    out_r, p_r = _attention(q_r, k_r, v_r)
    assert torch.allclose(p_r, p, atol=1e-5)
    assert torch.allclose(rot.derotate_output(out_r, rv), out, atol=1e-5)


def test_permutation_has_no_effect_with_whole_row_groups():
    # METHOD.md: with one scale and zero per row, min-max quantization ignores channel order.
    torch.manual_seed(4)
    x = torch.randn(32, 2, 64)
    r_no_p = rot.compose(rot.eigenbasis(_random_spd(64, 5))[1], use_permutation=False).float()
    r_p = rot.compose(rot.eigenbasis(_random_spd(64, 5))[1]).float()
    perm = rot.bit_reversal_permutation(64)
    xa = rot.rotate_kv(x, r_no_p.expand(2, 64, 64))
    xb = rot.rotate_kv(x, r_p.expand(2, 64, 64))
    assert torch.allclose(xb, xa[..., perm], atol=1e-6)
    err_a = (fmt.fake_quantize(xa) - xa).norm()
    err_b = (fmt.fake_quantize(xb) - xb).norm()
    assert torch.allclose(err_a, err_b, rtol=1e-5)
    # With groups smaller than the row it can matter.
    assert not torch.allclose((fmt.fake_quantize(xa, 16) - xa).norm(), (fmt.fake_quantize(xb, 16) - xb).norm(), rtol=1e-5)


def test_group_index_validates():
    assert rot.group_index(9, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        rot.group_index(9, 2)
