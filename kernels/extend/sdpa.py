"""Extend (prefill) attention through torch's SDPA over the dequantized prefix: a second GPU path.

The Triton kernel (``triton_kernel.py``) reads the INT2 prefix straight from
the store and dequantizes it in every query block; this path dequantizes each
request's prefix once (``kernels/read``: one Triton pass straight to the
16-bit buffer on a GPU, the torch reference elsewhere), rounds the rotated
queries, keys and values to ``q``'s dtype when it is 16-bit (a server's
bf16; fp32 inputs stay fp32) and runs ``scaled_dot_product_attention``
over prefix + new tokens with the lower-right causal mask, which torch serves with its flash
kernel on a GPU (a dense BF16 prefill's speed, plus the dequantization).
Where torch says its flash kernel takes the shapes with fewer key/value heads
than query heads (``can_use_flash_attention`` with ``enable_gqa``: flash
attention reads each KV head for its group of query heads), the KV heads go
in as they are; elsewhere they are expanded to the query heads first, which
every backend takes (transient memory per request: prefix + new tokens' keys
and values for every query head, 32 heads x 32k tokens x d 128 in bf16:
512 MiB, against 128 MiB for 8 KV heads as they are).  A server's prefill on
CUDA by default since 2026-12-05 (``settings.extend_path``; the Triton kernel
with ``OSCAR_SGLANG_EXTEND_KERNEL=kernel``), anywhere with
``OSCAR_SGLANG_EXTEND_KERNEL=sdpa``; the numerics are the reference's with
bf16 operands (``tests/test_kernels_extend.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_sglang.rotation import derotate_output

from .. import api
from ..common.reference import expand_groups
from ..layout import DeviceRotation, LayerStore, triton_unsupported
from .reference import rotated_requests

# torch's lower-right CausalBias (flash attention serves it) on a GPU; the same mask as booleans elsewhere,
# since its module imports Triton, which a CPU server never does.  True / False: either everywhere (tests).
CAUSAL_BIAS: bool | None = None
# KV heads as they are (enable_gqa) where torch's flash kernel takes them, else expanded (None); True / False:
# either everywhere (tests).
GQA_NATIVE: bool | None = None
# How the prefix is read (kernels/read): "auto" (the Triton read kernel on CUDA, torch elsewhere), "torch" or
# "triton" (tests: the kernel under the interpreter on CPU).
READ_BACKEND = "auto"


def lower_right_causal(ext: int, total: int, device: torch.device):
    """Mask of ``ext`` new tokens after ``total - ext`` cached ones: token ``i`` sees keys ``<= total - ext + i``."""
    if CAUSAL_BIAS or (CAUSAL_BIAS is None and device.type == "cuda"):
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(ext, total)
    return torch.arange(total, device=device)[None, :] <= total - ext + torch.arange(ext, device=device)[:, None]


def gqa_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """torch's description of this path's SDPA call with the KV heads as they are, for its backend checks.

    No mask, no dropout, not ``is_causal``: the lower-right ``CausalBias`` asks the same of flash.
    """
    from torch.backends.cuda import SDPAParams

    return SDPAParams(q, k, v, None, 0.0, False, True)  # ..., attn_mask, dropout, is_causal, enable_gqa


def flash_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's flash kernel serves ``[1, heads, tokens, d]`` queries over fewer KV heads as they are."""
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import can_use_flash_attention

    return can_use_flash_attention(gqa_params(q, k, v))


def read_backend(store: LayerStore, device_type: str) -> str:
    """How this path reads ``store``'s prefix: :data:`READ_BACKEND` where set; else the Triton read kernel on
    CUDA for the shapes and formats the Triton kernels take (``triton_unsupported``), the torch reference
    elsewhere (as the pool's own kernels fall back)."""
    if READ_BACKEND != "auto":
        return READ_BACKEND
    usable = triton_unsupported(store.head_dim, store.k_format, store.v_format) is None
    return "triton" if device_type == "cuda" and usable else "torch"


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float,
                     extend_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`oscar_sglang.kernels.extend.reference.extend_attention` with 16-bit operands through SDPA."""
    n, q_heads, d = q.shape
    work = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = torch.zeros(n, q_heads, d, dtype=work, device=q.device)
    backend = read_backend(store, q.device.type)

    def read(slots, into):
        api.read_rows(store, slots, work, into, backend=backend)

    def heads(x):  # [tokens, heads, d] -> [1, heads, tokens, d]
        return x.transpose(0, 1).unsqueeze(0)

    for rows, qr, keys, vals in rotated_requests(q, k, v, store, rot, req_to_token, req_pool_indices, prefix_lens,
                                                 extend_lens, extend_start_loc, work, read):
        ext, total = qr.shape[0], keys.shape[0]
        q4, k4, v4 = heads(qr), heads(keys), heads(vals)
        gqa = False
        if k4.shape[1] != q_heads:
            gqa = flash_takes_gqa(q4, k4, v4) if GQA_NATIVE is None else GQA_NATIVE
            if not gqa:
                k4, v4 = heads(expand_groups(keys, q_heads)), heads(expand_groups(vals, q_heads))
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=lower_right_causal(ext, total, q.device),
                                           scale=sm_scale, enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    return derotate_output(out, rot.v_rot).to(q.dtype)
