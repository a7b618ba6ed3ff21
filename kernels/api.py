"""What the SGLang backend calls: Triton on CUDA tensors, the plain-torch reference on CPU.

``backend`` selects explicitly: ``"auto"`` (default: Triton when the tensors
are on CUDA), ``"torch"`` or ``"triton"``.  Triton on CPU tensors needs the
interpreter: call :func:`oscar_sglang.kernels.interpret.enable` first (tests
and the CPU smoke benchmark do).  Triton modules are imported lazily, so the
CPU path never imports Triton.
"""

from __future__ import annotations

import importlib

import torch

from .layout import DeviceRotation, LayerStore, triton_unsupported  # noqa: F401  (re-exported for the pool)

BACKENDS = ("auto", "torch", "triton")
EXTEND_BACKENDS = (*BACKENDS, "sdpa")  # extend only: the prefix dequantized, then torch SDPA (extend/sdpa.py)


def _op(name: str, backend: str, device: torch.device):
    """The module implementing op ``name`` for this backend and device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    if not use_triton:
        return importlib.import_module(f"{__package__}.{name}.reference")
    if device.type != "cuda":
        from . import interpret

        if not interpret.active():
            raise RuntimeError("Triton kernels on CPU tensors need the interpreter: "
                               "call oscar_sglang.kernels.interpret.enable() first")
    return importlib.import_module(f"{__package__}.{name}.triton_kernel")


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, store: LayerStore, rot: DeviceRotation,
             hot_loc: torch.Tensor | None = None, *, backend: str = "auto") -> None:
    """Rotate, clip, quantize and store ``k, v [n, kv_heads, d]`` at ``slots [n]``; BF16 copies where ``hot_loc >= 0``.

    The caller keeps ``hot_index`` in step (``hot_index[slots] = hot_loc``).
    """
    _op("write", backend, k.device).write_kv(k, v, slots, store, rot, hot_loc)


def read_rows(store: LayerStore, slots: torch.Tensor, dtype: torch.dtype,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, *,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``k', v' [n, kv_heads, d]`` in ``dtype`` at ``slots [n]``: BF16 copies where hot, dequantized
    elsewhere (the sdpa prefill path's prefix); into ``out`` (two contiguous tensors of that shape) if given."""
    return _op("read", backend, slots.device).read_rows(store, slots, dtype, out)


def decode_attention(q: torch.Tensor, store: LayerStore, rot: DeviceRotation, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None,
                     *, backend: str = "auto", **tuning) -> torch.Tensor:
    """Decode attention, ``q [batch, q_heads, d]`` -> ``[batch, q_heads, d]`` (``q.dtype``).

    ``tuning`` (Triton only): ``num_splits``, ``max_seq_len`` (caps the splits
    without a host sync), ``block_n``, ``num_warps``, ``num_stages``,
    ``rotate_q_in_kernel`` (default: by grid size), ``hot_skip``, ``prefetch``.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    op = _op("decode", backend, q.device)
    return op.decode_attention(q, store, rot, req_to_token, req_pool_indices, seq_lens, sm_scale,
                               **(tuning if op.__name__.endswith("triton_kernel") else {}))


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, rot: DeviceRotation,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float | None = None,
                     extend_start_loc: torch.Tensor | None = None, *, backend: str = "auto",
                     **tuning) -> torch.Tensor:
    """Extend attention of new tokens ``q [N, q_heads, d]`` over their cached prefix and each other.

    ``tuning`` (Triton only): ``max_extend_len`` (avoids a host sync),
    ``max_prefix_len`` (lets the kernel split a long cached prefix, without a
    host sync), ``num_splits``, ``block_rows``, ``block_n``, ``num_warps``, ``num_stages``, ``dots``
    (``"bf16"``, the default, or ``"tf32"``: the dots' operands).  ``backend="sdpa"`` (extend only): the
    prefix dequantized, then torch's SDPA (flash on a GPU), ``extend/sdpa.py``.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if backend == "sdpa":
        op = importlib.import_module(f"{__package__}.extend.sdpa")
    else:
        op = _op("extend", backend, q.device)
    return op.extend_attention(q, k, v, store, rot, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                               sm_scale, extend_start_loc,
                               **(tuning if op.__name__.endswith("triton_kernel") else {}))


def repin_windows(stamp: torch.Tensor, hot_index: torch.Tensor, req_len: torch.Tensor, req_pass: torch.Tensor,
                  req_to_token: torch.Tensor, sink: int, recent: int, spread: torch.Tensor | None = None, *,
                  backend: str = "auto") -> None:
    """Every hot entry in the window of a live request row gets at least that row's last pass as stamp.

    See ``repin/reference.py``; ``spread`` (reference only): where its no-op updates go.
    """
    _op("repin", backend, stamp.device).repin_windows(stamp, hot_index, req_len, req_pass, req_to_token, sink,
                                                     recent, spread)


def hot_decode_pass(hs, loc: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, req_to_token: torch.Tensor,
                    live: torch.Tensor | None, repin) -> torch.Tensor:
    """A decode pass of ``HotSet`` ``hs`` in Triton (``hot_pass/triton_kernel.py``); returns ``hot_loc``.

    Triton only (CUDA, or the interpreter on CPU): the torch path is ``HotSet``'s own.
    """
    return _op("hot_pass", "triton", loc.device).decode_pass(hs, loc, rows, seq, req_to_token, live, repin)
