"""oscar-sglang's stand-in for ``sgl_kernel`` (distribution ``oscar-sgl-kernel-standin``).

The real ``sgl_kernel`` is a CUDA build too large to travel, and it cannot load
without CUDA.  This package takes its place in two settings:

* CPU machines: ``scripts/setup_env.sh`` installs it (CPU variant).  SGLang's
  CPU engine imports ``sgl_kernel`` but never calls it on the torch-native path.
* The GPU test machine: the device bundle (``scripts/device/``) installs it, so
  the real SGLang server runs on CUDA without the real ``sgl_kernel``.

On CUDA, SGLang imports a few kernels from here at module level and calls them
on a plain BF16 Llama/Qwen2 path.  Those are written below in torch, with the
signatures SGLang calls (keywords of the real API accepted, ``enable_pdl``
ignored); like the CUDA kernels they compute in float32 and cast back to the
input dtype.  Every other name, here and in the submodules ``kvcacheio``,
``quantization`` and ``utils``, is a function that raises NotImplementedError
when called.  The submodules ``scalar_type``, ``allreduce``, ``flash_attn`` and
``mamba`` are deliberately absent: where importing them fails, SGLang uses its
own code.
"""

from functools import partial
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

# Imported eagerly so that ``from sgl_kernel import utils`` finds the submodule;
# otherwise the module ``__getattr__`` below would answer with a stand-in function.
from . import kvcacheio, quantization, utils  # noqa: F401
from ._standin import module_getattr

__getattr__ = module_getattr(__name__, absent=("scalar_type", "allreduce", "flash_attn", "mamba"))


def _store(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


# --- RMS norms: out = x / sqrt(mean(x^2) + eps) * w, with w = weight (Llama) or 1 + weight (Gemma).

def _rms_norm(x32: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * (weight.float() + weight_offset)


def _fused_add(input, residual, weight, eps, weight_offset) -> None:
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms_norm(total, weight, eps, weight_offset))


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None) -> torch.Tensor:
    """``input / RMS(input) * weight``, into ``out`` when given."""
    return _store(_rms_norm(input.float(), weight, eps, 0.0).to(input.dtype), out)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None) -> None:
    """In place: ``residual += input``, then ``input = rmsnorm(residual, weight)``."""
    _fused_add(input, residual, weight, eps, 0.0)


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None) -> torch.Tensor:
    """``input / RMS(input) * (1 + weight)``, into ``out`` when given."""
    return _store(_rms_norm(input.float(), weight, eps, 1.0).to(input.dtype), out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None) -> None:
    """In place: ``residual += input``, then ``input = gemma_rmsnorm(residual, weight)``."""
    _fused_add(input, residual, weight, eps, 1.0)


# --- Gated activations: act(x[..., :d]) * x[..., d:] with d = last dim / 2.

def _act_and_mul(act, input: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    d = input.shape[-1] // 2
    x = input.float()
    return _store((act(x[..., :d]) * x[..., d:]).to(input.dtype), out)


def silu_and_mul(input, out=None) -> torch.Tensor:
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input, out=None) -> torch.Tensor:
    """Exact (erf) GELU."""
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input, out=None) -> torch.Tensor:
    """GELU with the tanh approximation."""
    return _act_and_mul(partial(F.gelu, approximate="tanh"), input, out)


# --- Sampling renormalization (FlashInfer's threshold semantics: every tie with the pivot is kept).

def _per_row(value, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=dtype).reshape(-1)
        return value.expand(rows) if value.numel() == 1 else value
    return torch.full((rows,), value, dtype=dtype, device=device)


def _keep_from_pivot(probs: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= pivot.unsqueeze(-1), probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    """Per row, keep the probabilities >= the top_k-th largest one and renormalize (float32).

    ``top_k`` is one int or one value per row; values beyond the vocabulary keep everything.
    """
    probs = probs.float()
    k = _per_row(top_k, probs.shape[0], torch.int64, probs.device).clamp(1, probs.shape[-1])
    descending = probs.sort(dim=-1, descending=True).values
    return _keep_from_pivot(probs, descending.gather(-1, (k - 1).unsqueeze(-1)).squeeze(-1))


def top_p_renorm_prob(probs: torch.Tensor, top_p: Union[torch.Tensor, float]) -> torch.Tensor:
    """Per row, drop the least probable tokens while their total mass stays below ``1 - top_p``;
    keep the rest (and every tie with the smallest kept probability) and renormalize (float32).

    ``top_p`` is one float or one value per row.
    """
    probs = probs.float()
    p = _per_row(top_p, probs.shape[0], torch.float32, probs.device)
    ascending = probs.sort(dim=-1).values
    first_kept = torch.searchsorted(ascending.cumsum(dim=-1), (1.0 - p).unsqueeze(-1))
    first_kept = first_kept.clamp(max=probs.shape[-1] - 1)
    return _keep_from_pivot(probs, ascending.gather(-1, first_kept).squeeze(-1))


# --- Attention.

def merge_state_v2(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_merged: Optional[torch.Tensor] = None,
    s_merged: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results by their log-sum-exps (natural log).

    ``v_*``: [tokens, heads, head_dim]; ``s_*``: [tokens, heads].  An LSE of +inf
    counts as -inf (an empty part).  Returns ``(v_merged, s_merged)``, written into
    the given tensors when passed; ``s_merged`` is float32 by default.
    """
    s_a, s_b = (torch.where(s == float("inf"), float("-inf"), s.float()) for s in (s_a, s_b))
    s_max = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - s_max), torch.exp(s_b - s_max)
    total = w_a + w_b
    v = v_a.float() * (w_a / total).unsqueeze(-1) + v_b.float() * (w_b / total).unsqueeze(-1)
    if v_merged is None:
        v_merged = torch.empty_like(v_a)
    if s_merged is None:
        s_merged = torch.empty_like(s_a)
    v_merged.copy_(v)
    s_merged.copy_(torch.log(total) + s_max)
    return v_merged, s_merged


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Returns ``tensor`` itself.

    The CUDA kernel returns a non-owning alias, so that CUDA graph capture does not
    keep graph outputs alive; handing back the tensor itself is correct, it only
    holds that memory for as long as the graph runner keeps the reference.
    """
    return tensor
