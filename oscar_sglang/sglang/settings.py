"""Launch settings of the INT2 cache and how they reach every SGLang process.

``ServerArgs`` is a sealed record, so the oscar flags travel as environment
variables: the launcher sets them while parsing the command line (before any
scheduler subprocess starts) and every process reads them back here.  A
programmatic caller (``sglang.Engine``) may set the variables itself.

This module imports no SGLang code, so it can be used and tested anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from oscar_sglang import artifacts

KV_CACHE_DTYPE = "oscar-int2"
BACKEND_NAME = "oscar_int2"

ENV_ROTATIONS = "OSCAR_SGLANG_ROTATIONS"
ENV_SINK = "OSCAR_SGLANG_SINK"
ENV_RECENT = "OSCAR_SGLANG_RECENT"
ENV_HOT_REQUESTS = "OSCAR_SGLANG_HOT_REQUESTS"
# Benchmark knob: a fixed KV memory budget in bytes instead of SGLang's profile
# of free memory (which is noisy on a shared CPU machine).  Applies to every
# --kv-cache-dtype, so BF16 and INT2 capacities can be compared exactly.
ENV_KV_BUDGET = "OSCAR_SGLANG_KV_BUDGET_BYTES"
# Where a decode CUDA graph's hot pool update runs: "graph" (recorded in the
# graph, the default) or "eager" (before each replay, launched from the
# host): the way back if recording it ever fails on a GPU.
ENV_GRAPH_HOT_UPDATE = "OSCAR_SGLANG_GRAPH_HOT_UPDATE"
GRAPH_HOT_UPDATES = ("graph", "eager")

# The prefill (extend) path: "sdpa" (the prefix dequantized, then torch's SDPA:
# flash attention on a GPU, kernels/extend/sdpa.py; the default on a GPU since
# 2026-12-05), "kernel" (the Triton extend kernel with its defaults), or that
# kernel's tile and dots, e.g. "block_rows=128,block_n=64" or "dots=tf32": what
# the kernel benchmark's prefill section found faster on a GPU, tried on the
# real server without a code change (a rerun on a lent machine).  Unset: sdpa on
# CUDA, the pool's kernels elsewhere (the torch reference on CPU).
ENV_EXTEND_KERNEL = "OSCAR_SGLANG_EXTEND_KERNEL"
EXTEND_SDPA = "sdpa"
EXTEND_TRITON = "kernel"
EXTEND_INT_KEYS = ("block_rows", "block_n", "num_warps", "num_stages")
EXTEND_DOTS = ("bf16", "tf32")   # = kernels/extend/triton_kernel.DOT_CHOICES (not imported: no Triton here; a test pins them)
# The decode kernel's loop.  Unset or "auto": on CUDA the server times the
# loop's candidates once at startup on its own GPU and Triton and keeps the
# fastest (kernels/decode/autotune.py; its choice is logged as the value
# that serves it); "default": the kernel's defaults, nothing timed; or
# options fixed, e.g. "block_n=64,num_warps=8": what the kernel benchmark's
# decode tile sweep found faster on a GPU (goals.py's "decode tiles" line),
# tried on the real server the same way.
ENV_DECODE_KERNEL = "OSCAR_SGLANG_DECODE_KERNEL"
DECODE_AUTO, DECODE_DEFAULT = "auto", "default"
DECODE_INT_KEYS = ("block_n", "num_warps", "num_stages", "max_registers", "resident", "hot_weight")
# and the loop's variants (kernels/decode/triton_kernel.decode_attention; pinned there by a test), e.g.
# "dots=bf16", "prefetch=0,hot_skip=0" (the first H200 run's loop), "hot_loop=1" (blocks with a hot row in a
# loop of their own), "fold=1" (folded scales) or "fold=1,num_warps=2,unpack_first=1" (the folded loop's values
# unpacked before they are transposed); and
# "max_registers=128" (the compiler's registers per thread at most, 16..255: more warps resident per
# multiprocessor, some spills; kernels/occupancy.py) and "resident=4" (the split count for one whole wave of
# that many programs per multiprocessor, 1..64, as decode_variants' "Grids" table reports the compiled kernel's,
# the CUDA graphs' split count included), "hot_weight=0" (the splits cut evenly, not by work: a block of the
# sink or recent window weighs 4 quarters of a cold block instead of the loop's default, 20 for the fold and 6
# for the others; 4..64 otherwise; kernels/decode/split_cut.py)
DECODE_CHOICES = {"dots": ("tf32", "bf16"), "prefetch": ("0", "1", "2"), "hot_skip": ("0", "1"), "fold": ("0", "1"),
                  "hot_loop": ("0", "1"), "unpack_first": ("0", "1")}
_INT_RANGES = {"max_registers": (16, 255), "resident": (1, 64), "hot_weight": (0, 64)}  # not tile sizes
_CHOICE_VALUE = {"prefetch": int, "hot_skip": lambda raw: raw == "1", "fold": lambda raw: raw == "1",
                 "hot_loop": lambda raw: raw == "1", "unpack_first": lambda raw: raw == "1"}

# Concurrent requests whose sink and recent windows the BF16 hot side pool
# holds (capped by --max-running-requests when that is smaller).
DEFAULT_HOT_REQUESTS = 32

MISSING_ROTATIONS = (
    f"--kv-cache-dtype {KV_CACHE_DTYPE} needs --oscar-rotations DIR, a rotations directory for the served "
    "model; create one with `oscar-calibrate --model MODEL --out DIR`"
)


class OscarConfigError(ValueError):
    """A launch configuration the INT2 cache cannot serve; the message says what to change."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the operator asked for: the rotations directory and optional window and hot-pool overrides."""

    rotations: Path
    sink: int | None = None
    recent: int | None = None
    hot_requests: int | None = None

    def export(self, environ=os.environ) -> None:
        """Write the settings to the environment inherited by subprocesses."""
        environ[ENV_ROTATIONS] = str(self.rotations)
        for name, value in ((ENV_SINK, self.sink), (ENV_RECENT, self.recent),
                            (ENV_HOT_REQUESTS, self.hot_requests)):
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = str(value)

    @classmethod
    def from_env(cls, environ=os.environ) -> "LaunchSettings":
        """Read the settings back; raises :class:`OscarConfigError` when rotations are missing."""
        rotations = environ.get(ENV_ROTATIONS)
        if not rotations:
            raise OscarConfigError(MISSING_ROTATIONS)
        return cls(Path(rotations), _int_or_none(environ, ENV_SINK), _int_or_none(environ, ENV_RECENT),
                   _int_or_none(environ, ENV_HOT_REQUESTS))


def _int_or_none(environ, name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise OscarConfigError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise OscarConfigError(f"{name}={value} must be >= 0")
    return value


@dataclass(frozen=True)
class ServingConfig:
    """Validated artifacts plus the window sizes in effect (flags override the artifact's defaults)."""

    artifacts: artifacts.RotationArtifacts
    sink: int
    recent: int
    hot_requests: int = DEFAULT_HOT_REQUESTS
    kv_heads: tuple[int, ...] | None = None   # the model's KV heads these artifacts hold; None: all of them
    # SGLang's CPU engine pads a model's heads to a multiple of --tp-size (zero weights): the padded KV head
    # count (None: not padded)
    padded_kv_heads: int | None = None

    @property
    def padding_heads(self) -> int:
        """How many neutral padding heads follow ``kv_heads`` in this rank's share of the artifacts."""
        if self.kv_heads is None:
            return 0
        return self.artifacts.layers[0].k_rotation.shape[0] - len(self.kv_heads)

    @property
    def layer_formats(self) -> list:
        """Each model layer's K and V row formats (``artifacts.LayerFormat``)."""
        return self.artifacts.layer_formats

    @property
    def bits_per_element(self) -> float:
        """Average stored bits per K/V element over all layers (scale and zero included)."""
        return self.artifacts.bits_per_element

    def for_rank(self, tp_size: int, tp_rank: int) -> "ServingConfig":
        """This config with the rotations of the KV heads a tensor-parallel rank serves (on SGLang's CPU engine
        with padded heads, its share of the padded heads: the model's first, neutral rotations for the rest)."""
        total = self.artifacts.model.num_kv_heads
        heads = kv_heads_of_rank(self.padded_kv_heads or total, tp_size, tp_rank)
        if heads == list(range(total)):
            return self
        real = [h for h in heads if h < total]
        return replace(self, artifacts=self.artifacts.for_kv_heads(real, len(heads) - len(real)),
                       kv_heads=tuple(real))

    def heads_note(self) -> str:
        """Which of the model's KV heads this config serves, for the startup line ("" for all of them)."""
        if self.kv_heads is None:
            return ""
        total, heads = self.artifacts.model.num_kv_heads, self.kv_heads
        pads = f"{self.padding_heads} padding head{'s' if self.padding_heads > 1 else ''}"
        if heads:
            span = f"head {heads[0]}" if len(heads) == 1 else f"heads {heads[0]}-{heads[-1]}"
            share = f"KV {span} of {total}" + (f" and {pads}" if self.padding_heads else "")
        else:
            share = f"{pads} only"
        note = "this tensor-parallel rank's share"
        if self.padded_kv_heads:
            note += f"; SGLang's CPU engine pads the {total} KV heads to {self.padded_kv_heads}"
        return f", {share} ({note})"


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads a tensor-parallel rank holds, as SGLang shards the QKV projection.

    ``tp_size <= total``: an equal contiguous share; ``tp_size > total``: one
    head, replicated over ``tp_size / total`` consecutive ranks.
    """
    if not 0 <= tp_rank < tp_size:
        raise OscarConfigError(f"tensor-parallel rank {tp_rank} outside a group of {tp_size}")
    if tp_size >= total_kv_heads:
        if tp_size % total_kv_heads:
            raise OscarConfigError(f"{tp_size} tensor-parallel ranks cannot share {total_kv_heads} KV heads evenly")
        return [tp_rank // (tp_size // total_kv_heads)]
    if total_kv_heads % tp_size:
        raise OscarConfigError(f"{total_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")
    per_rank = total_kv_heads // tp_size
    return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


@lru_cache(maxsize=4)
def _load_cached(directory: str, fingerprint: artifacts.ModelFingerprint) -> artifacts.RotationArtifacts:
    return artifacts.load(directory, expect=fingerprint)


def serving_config(hf_config, environ=os.environ) -> ServingConfig:
    """Load and validate the artifacts against the served model's config (cached per process).

    Raises :class:`oscar_sglang.artifacts.ArtifactError` on any mismatch and
    :class:`OscarConfigError` when no rotations were given.
    """
    settings = LaunchSettings.from_env(environ)
    fp, padded = served_fingerprint(hf_config)
    art = _load_cached(str(settings.rotations.resolve()), fp)
    sink = art.sink if settings.sink is None else settings.sink
    recent = art.recent if settings.recent is None else settings.recent
    hot = DEFAULT_HOT_REQUESTS if settings.hot_requests is None else settings.hot_requests
    return ServingConfig(art, sink, recent, hot, padded_kv_heads=padded)


def served_fingerprint(hf_config) -> tuple[artifacts.ModelFingerprint, int | None]:
    """The served model's fingerprint as it was calibrated, and the KV head count SGLang padded it to (None if
    it did not).

    SGLang's CPU engine serves ``--tp-size N`` with head counts that N does not divide by padding the heads with
    zero weights up to a multiple of N (``configs/update_config.adjust_config_with_unaligned_cpu_tp``): the
    config then says the padded counts and keeps the model's own in ``original_num_attention_heads`` and
    ``original_total_num_kv_heads``.
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    fp = artifacts.ModelFingerprint.from_config(hf_config)
    q, kv = getattr(text, "original_num_attention_heads", None), getattr(text, "original_total_num_kv_heads", None)
    if q is None or kv is None or (int(q), int(kv)) == (fp.num_attention_heads, fp.num_kv_heads):
        return fp, None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // int(q)
    return replace(fp, num_attention_heads=int(q), num_kv_heads=int(kv), head_dim=int(head_dim)), fp.num_kv_heads


def graph_hot_update(environ=os.environ) -> str:
    """Where decode CUDA graphs update the hot pool (:data:`ENV_GRAPH_HOT_UPDATE`): "graph" or "eager"."""
    value = environ.get(ENV_GRAPH_HOT_UPDATE) or GRAPH_HOT_UPDATES[0]
    if value not in GRAPH_HOT_UPDATES:
        raise OscarConfigError(f"{ENV_GRAPH_HOT_UPDATE}={value!r}: expected one of {', '.join(GRAPH_HOT_UPDATES)}")
    return value


def extend_kernel_options(environ=os.environ) -> dict:
    """Keyword arguments for the Triton extend kernel from :data:`ENV_EXTEND_KERNEL` (``{}`` when unset), or
    ``{"backend": "sdpa"}`` for :data:`EXTEND_SDPA` (``kernels.api.extend_attention``'s SDPA path), or
    ``{"backend": "kernel"}`` for :data:`EXTEND_TRITON` (the kernel with its defaults)."""
    value = environ.get(ENV_EXTEND_KERNEL, "").strip()
    if value in (EXTEND_SDPA, EXTEND_TRITON):
        return {"backend": value}
    return _kernel_options(environ, ENV_EXTEND_KERNEL, EXTEND_INT_KEYS, {"dots": EXTEND_DOTS})


def extend_path(device_type: str, environ=os.environ) -> tuple[str | None, dict]:
    """The backend's prefill path on ``device_type``: ``("sdpa", {})`` or ``(None, kernel options)`` (the pool's
    kernels: Triton on CUDA, the torch reference on CPU).

    Unset knob: the sdpa path on CUDA, since the H200 ran it ~5x as fast as the Triton extend kernel over a
    32k prompt (docs/GPU.md, run 1); elsewhere the pool's kernels (the interpreter's tests keep the kernel).
    """
    options = extend_kernel_options(environ)
    choice = options.pop("backend", None)
    if choice is None and not options and device_type == "cuda":
        choice = EXTEND_SDPA
    return (EXTEND_SDPA if choice == EXTEND_SDPA else None), options


def decode_kernel_options(environ=os.environ) -> dict:
    """Keyword arguments for the Triton decode kernel from :data:`ENV_DECODE_KERNEL` (``{}`` when unset,
    :data:`DECODE_AUTO` or :data:`DECODE_DEFAULT`)."""
    if environ.get(ENV_DECODE_KERNEL, "").strip() in (DECODE_AUTO, DECODE_DEFAULT):
        return {}
    return _kernel_options(environ, ENV_DECODE_KERNEL, DECODE_INT_KEYS, DECODE_CHOICES)


def decode_kernel_autotuned(environ=os.environ) -> bool:
    """Whether :data:`ENV_DECODE_KERNEL` leaves the decode loop to the startup timing (unset, or
    :data:`DECODE_AUTO`); the backend does it on CUDA only."""
    return environ.get(ENV_DECODE_KERNEL, "").strip() in ("", DECODE_AUTO)


def _kernel_options(environ, name: str, int_keys: tuple, choices: dict) -> dict:
    """``KEY=VALUE,...`` of a kernel knob: integer tile keys (powers of two; ``block_n``, a dot's inner size,
    at least 16; ``num_stages`` any positive integer; ``max_registers`` and ``resident`` in their ranges) and keys with a few ``choices`` (``dots``; the decode
    loop's ``prefetch``, ``hot_skip`` and ``fold``)."""
    value = environ.get(name, "").strip()
    keys = (*int_keys, *choices)
    options: dict = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, raw = (x.strip() for x in item.partition("="))
        if not sep or key not in keys or key in options:
            raise OscarConfigError(f"{name}={value!r}: expected comma-separated KEY=VALUE, each key "
                                   f"once, of {', '.join(keys)}"
                                   + (f"; or {EXTEND_SDPA}, or {EXTEND_TRITON}" if name == ENV_EXTEND_KERNEL else "")
                                   + (f"; or {DECODE_AUTO}, or {DECODE_DEFAULT}" if name == ENV_DECODE_KERNEL else ""))
        if key in choices:
            if raw not in choices[key]:
                raise OscarConfigError(f"{name}: {key}={raw!r}, expected one of {', '.join(choices[key])}")
            options[key] = _CHOICE_VALUE.get(key, str)(raw)
            continue
        n = int(raw) if raw.isdigit() else 0
        if key == "num_stages":
            if n == 0:
                raise OscarConfigError(f"{name}: {key}={raw!r}, expected a positive integer")
        elif key in _INT_RANGES:
            lo, hi = _INT_RANGES[key]
            if not lo <= n <= hi or (key == "hot_weight" and 0 < n < 4):
                raise OscarConfigError(f"{name}: {key}={raw!r}, expected an integer within {lo}..{hi}"
                                       + (" (0, or 4 and more)" if key == "hot_weight" else ""))
        elif n == 0 or n & (n - 1) or (key == "block_n" and n < 16):
            raise OscarConfigError(f"{name}: {key}={raw!r}, expected a power of two"
                                   + (" >= 16" if key == "block_n" else ""))
        options[key] = n
    return options


def kv_budget_bytes(environ=os.environ) -> int | None:
    """The fixed KV budget of :data:`ENV_KV_BUDGET`, or None (SGLang profiles free memory)."""
    value = _int_or_none(environ, ENV_KV_BUDGET)
    if value == 0:
        raise OscarConfigError(f"{ENV_KV_BUDGET} must be > 0")
    return value
