"""Command line and server-argument resolution: ``--kv-cache-dtype oscar-int2`` and the ``--oscar-*`` flags.

* ``ServerArgs.add_cli_args`` (after): adds ``oscar-int2`` to the
  ``--kv-cache-dtype`` choices and the ``--oscar-rotations DIR``,
  ``--oscar-sink N``, ``--oscar-recent N``, ``--oscar-hot-requests N`` flags.
* ``ServerArgs.from_cli_args`` (around): checks the flags, refuses what
  ``compat`` lists (one sentence each), validates the artifacts against the
  model's config, and exports the settings to the
  environment the scheduler subprocesses inherit (``ServerArgs`` is sealed).
  A bad launch exits with one sentence, as argparse does.
* Resolution steps (SGLang's ``register_resolution_hook``): with
  ``oscar-int2`` the attention backend is ``oscar_int2``, and the prefill
  phase's CUDA graphs are off (the backend captures decode only).  Decode
  graphs follow SGLang's own flags: ``--disable-cuda-graph``,
  ``--disable-decode-cuda-graph`` or ``--cuda-graph-backend-decode disabled``
  turn them off.
"""

from __future__ import annotations

import logging
import os

from oscar_sglang import artifacts

from . import compat
from .settings import (BACKEND_NAME, DEFAULT_HOT_REQUESTS, ENV_ROTATIONS, KV_CACHE_DTYPE, MISSING_ROTATIONS,
                       LaunchSettings, OscarConfigError)

logger = logging.getLogger(__name__)

SOURCE = "oscar_sglang"


def add_cli_args(_result, parser) -> None:
    """After ``ServerArgs.add_cli_args(parser)``: extend ``--kv-cache-dtype`` and add the oscar flags."""
    dtype_actions = [a for a in parser._actions if a.dest == "kv_cache_dtype"]
    if len(dtype_actions) != 1 or dtype_actions[0].choices is None:
        raise RuntimeError("oscar-sglang: SGLang's --kv-cache-dtype option changed shape; "
                           "this plugin supports sglang==0.5.23")
    action = dtype_actions[0]
    if KV_CACHE_DTYPE not in action.choices:
        action.choices = [*action.choices, KV_CACHE_DTYPE]
        action.help = (action.help or "") + f' "{KV_CACHE_DTYPE}": 2-bit KV cache with rotations (oscar-sglang).'
    group = parser.add_argument_group("oscar-sglang (2-bit KV cache)")
    group.add_argument("--oscar-rotations", metavar="DIR", default=None,
                       help="rotations directory for the served model (from `oscar-calibrate --model MODEL "
                            "--out DIR`); required with --kv-cache-dtype oscar-int2")
    group.add_argument("--oscar-sink", metavar="N", type=int, default=None,
                       help="first N tokens of each sequence kept in BF16 (default: the artifact's)")
    group.add_argument("--oscar-recent", metavar="N", type=int, default=None,
                       help="last N tokens of each sequence kept in BF16 (default: the artifact's)")
    group.add_argument("--oscar-hot-requests", metavar="N", type=int, default=None,
                       help="running requests whose sink and recent windows the BF16 side pool holds "
                            f"(default {DEFAULT_HOT_REQUESTS}, at most --max-running-requests); more requests "
                            "still work, reading their oldest recent tokens from INT2")


def launch_settings(args) -> LaunchSettings | None:
    """The oscar settings of a parsed command line, or None without oscar-int2; raises on a bad launch."""
    rotations = getattr(args, "oscar_rotations", None)
    sink, recent = getattr(args, "oscar_sink", None), getattr(args, "oscar_recent", None)
    hot = getattr(args, "oscar_hot_requests", None)
    if getattr(args, "kv_cache_dtype", None) != KV_CACHE_DTYPE:
        if any(v is not None for v in (rotations, sink, recent, hot)):
            raise OscarConfigError(f"--oscar-rotations, --oscar-sink, --oscar-recent and --oscar-hot-requests "
                                   f"apply only with --kv-cache-dtype {KV_CACHE_DTYPE}")
        return None
    if not rotations:
        raise OscarConfigError(MISSING_ROTATIONS)
    for flag, value in (("--oscar-sink", sink), ("--oscar-recent", recent), ("--oscar-hot-requests", hot)):
        if value is not None and value < 0:
            raise OscarConfigError(f"{flag} must be >= 0, got {value}")
    return LaunchSettings(os.path.abspath(rotations), sink, recent, hot)


def _check_artifacts_early(settings: LaunchSettings, args) -> None:
    """Validate the artifacts against the model's config in the launcher, before any subprocess starts.

    The schedulers validate again against the config SGLang loaded; this check
    only makes a mismatch fail fast.  A config that cannot be read here is left
    to SGLang.
    """
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(args.trust_remote_code),
                                            revision=getattr(args, "revision", None))
    except Exception as e:  # noqa: BLE001 - SGLang reports an unreadable model itself
        logger.info("oscar-sglang: model config not readable in the launcher (%s); schedulers will validate", e)
        return
    compat.check_model(config)
    artifacts.load(settings.rotations, expect=artifacts.ModelFingerprint.from_config(config))


def from_cli_args(original, cls, args):
    """Around ``ServerArgs.from_cli_args``: check and export the oscar settings, then build the record."""
    try:
        settings = launch_settings(args)
        if settings is not None:
            compat.check_launch(args)
            _check_artifacts_early(settings, args)
    except (OscarConfigError, artifacts.ArtifactError) as e:
        raise SystemExit(f"oscar-sglang: error: {e}") from None
    if settings is not None:
        settings.export()
    return original(cls, args)


def _uses_oscar(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args).kv_cache_dtype == KV_CACHE_DTYPE


def limit_cuda_graphs(server_args, previous) -> None:
    """Wraps the ``handle_cuda_graph_config`` step: with oscar-int2, CUDA graphs for decode only.

    Declares ``disable_prefill_cuda_graph`` (SGLang then locks the prefill
    phase off, so no later default turns it on) and leaves the decode phase to
    SGLang's flags.  An explicit prefill graph backend is refused.
    """
    if not _uses_oscar(server_args):
        previous(server_args)
        return
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend

    declare_resolution(server_args, SOURCE, disable_prefill_cuda_graph=True)
    previous(server_args)
    prefill = resolving_view(server_args).cuda_graph_config.prefill.backend
    if prefill != Backend.DISABLED:
        raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} captures CUDA graphs for decode only; drop the "
                               f"prefill graph backend {prefill!r} (--cuda-graph-backend-prefill or "
                               f"--cuda-graph-config)")


def select_attention_backend(server_args, previous) -> None:
    """Wraps the ``handle_attention_backend_compatibility`` step: oscar-int2 implies the oscar_int2 backend."""
    if _uses_oscar(server_args):
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        chosen = {f: getattr(server_args, f) for f in
                  ("attention_backend", "prefill_attention_backend", "decode_attention_backend")}
        others = {f: b for f, b in chosen.items() if b not in (None, BACKEND_NAME)}
        if others:
            flags = ", ".join(f"--{f.replace('_', '-')} {b}" for f, b in others.items())
            raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} is served by the {BACKEND_NAME} attention "
                                   f"backend only; drop {flags}")
        if not os.environ.get(ENV_ROTATIONS):
            raise OscarConfigError(MISSING_ROTATIONS)
        if resolving_view(server_args).speculative_algorithm is not None:
            raise OscarConfigError(f"--kv-cache-dtype {KV_CACHE_DTYPE} does not support speculative decoding yet")
        declare_resolution(server_args, SOURCE, attention_backend=BACKEND_NAME,
                           prefill_attention_backend=None, decode_attention_backend=None)
    previous(server_args)
