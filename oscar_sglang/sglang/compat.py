"""What ``--kv-cache-dtype oscar-int2`` supports, and one sentence for everything it refuses.

Every SGLang feature that would reach the INT2 pool through a door it does not
have (a dense K/V buffer, a host copy of the KV layout, a KV transfer between
servers) is either supported here or refused at startup, in the launcher
before any subprocess starts (``args.from_cli_args``) and again in each
scheduler (``memory._serving``), never with a crash mid-serving.  The tables
are the single place to read what is refused and why; ``tests/test_compat.py``
drives each row through SGLang's real argument parser and checks the model
table against SGLang's model sources.

Supported by a hook rather than refused: the fused RoPE + set-KV-buffer write
that SGLang takes on CUDA for several model families (Qwen3-MoE, Bailing,
GPT-OSS, SDAR, LLaDA2, Mellum) when the pool's dtype is bf16; with the INT2
pool, ``enable_fused_set_kv_buffer`` answers False (:func:`no_fused_kv_write`)
and the model takes its ordinary path (K and V handed to the attention backend,
which writes them).  Refused per request rather than at startup: a prompt of
no tokens (:func:`refuse_empty_prompt`), which SGLang 0.5.23 would schedule as
an extend of 0 tokens that kills its scheduler.  Speculative decoding and non-default attention backends
are refused by ``args.select_attention_backend``; MLA, hybrid and
sliding-window models by ``memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .settings import KV_CACHE_DTYPE, OscarConfigError


@dataclass(frozen=True)
class Refusal:
    """A launch option the INT2 cache refuses: ``flags`` (as typed), the test on SGLang's parsed args, why."""

    flags: tuple[str, ...]
    applies: Callable[[object], bool]
    reason: str

    def message(self) -> str:
        return f"--kv-cache-dtype {KV_CACHE_DTYPE} {self.reason}; drop {' '.join(self.flags)}"


def _on(name: str) -> Callable[[object], bool]:
    return lambda args: bool(getattr(args, name, False))


LAUNCH_REFUSALS = (
    Refusal(("--enable-hierarchical-cache",), _on("enable_hierarchical_cache"),
            "does not support HiCache yet: it copies KV rows to host memory in SGLang's dense layout, which the "
            "INT2 pool (codes, scales and a BF16 window pool) does not have"),
    Refusal(("--enable-lmcache",), _on("enable_lmcache"),
            "does not support LMCache yet: it reads and writes SGLang's dense KV buffers, which the INT2 pool "
            "does not have"),
    Refusal(("--enable-hisparse",), _on("enable_hisparse"),
            "does not support hierarchical sparse attention: it needs its own attention backend and KV layout"),
    Refusal(("--disaggregation-mode",), lambda a: getattr(a, "disaggregation_mode", "null") not in (None, "null"),
            "does not support prefill/decode disaggregation yet: the KV transfer between servers sends SGLang's "
            "dense buffers, not INT2 rows with their rotations and hot windows"),
    Refusal(("--enable-memory-saver",), _on("enable_memory_saver"),
            "does not support --enable-memory-saver: the INT2 pool's memory is not registered with the memory "
            "saver, so releasing it would silently do nothing"),
    Refusal(("--enable-torch-compile",), _on("enable_torch_compile"),
            "is not tested under torch.compile (the oscar_int2 backend's per-pass bookkeeping and Triton calls "
            "were never compiled); decode CUDA graphs are supported without it"),
)

# Models that hand the attention backend no K/V to write (``save_kv_cache=False``: a later loop or layer reads
# an earlier layer's cache, or a fused kernel wrote SGLang's dense buffer) outside AMD-only paths.
ARCHITECTURE_REFUSALS = {
    "IQuestLoopCoderForCausalLM": "its later loops read the first loop's KV cache without writing (save_kv_cache=False)",
    "HYV3ForCausalLM": "some of its layers attend over another layer's KV cache without writing it",
    "MiMoV2ForCausalLM": "some of its layers attend over another layer's KV cache without writing it",
    "MiMoV2FlashForCausalLM": "some of its layers attend over another layer's KV cache without writing it",
}


def check_launch(args) -> None:
    """Raise :class:`OscarConfigError` with one sentence for the first refused option in ``args``."""
    if getattr(args, "kv_cache_dtype", None) != KV_CACHE_DTYPE:
        return
    for r in LAUNCH_REFUSALS:
        if r.applies(args):
            raise OscarConfigError(r.message())


def check_model(hf_config) -> None:
    """Raise :class:`OscarConfigError` for a model whose attention does not write its K/V through the backend."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in ARCHITECTURE_REFUSALS:
            raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} does not support {arch}: "
                                   f"{ARCHITECTURE_REFUSALS[arch]}")


def no_fused_kv_write(original, *args, **kwargs):
    """Around ``sglang.srt.models.utils.enable_fused_set_kv_buffer``: never with the INT2 pool."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool, has_forward_context

    from .pool import OscarInt2Pool

    if has_forward_context() and isinstance(get_token_to_kv_pool(), OscarInt2Pool):
        return False
    return original(*args, **kwargs)


EMPTY_PROMPT = ("the prompt is empty (0 tokens); send at least one token of text or input_ids "
                "(--kv-cache-dtype " + KV_CACHE_DTYPE + ")")


def refuse_empty_prompt(tokenizer_manager, obj=None, input_ids=None, *args, **kwargs):
    """Before ``TokenizerManager._validate_one_request``: a request whose prompt has no tokens is a 400 with one
    sentence (SGLang answers the ValueError raised here as a bad request).

    SGLang 0.5.23 accepts it and, when nothing else is in the batch, schedules an extend of 0 tokens; the model's
    RoPE then fails to reshape the empty tensor and the scheduler dies, taking the server with it (measured on
    CPU with the BF16 cache as well: ``scripts/soak.py`` sends every malformed request alone). Batched with other
    prompts the same request is answered with tokens generated from no context. Only with oscar-int2: other
    servers are left as SGLang makes them."""
    embeds = getattr(obj, "input_embeds", None)
    if (input_ids is not None and len(input_ids) == 0 and embeds is None
            and getattr(getattr(tokenizer_manager, "server_args", None), "kv_cache_dtype", None) == KV_CACHE_DTYPE):
        raise ValueError(EMPTY_PROMPT)
