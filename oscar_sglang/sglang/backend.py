"""The ``oscar_int2`` attention backend: attention over the INT2 pool in rotated space.

Per forward pass, :meth:`OscarInt2AttnBackend.init_forward_metadata` updates
the hot side pool once for all layers (which new tokens get BF16 copies,
which slots left their recent window).  Per layer:

* every new token goes through the write path (rotate, clip, quantize, pack,
  store, BF16 copy where hot);
* queries are rotated once (``q' = q R_K``), scores and the weighted sum are
  taken against the stored rotated rows (BF16 where hot, INT2 elsewhere), and
  the output is de-rotated once (``o = o' R_V^T``);
* extend (prefill) attends to the exact new tokens plus the cached prefix as
  stored.

The numerics are those of ``oscar_sglang.kernels``: the Triton kernels on
CUDA, the plain-torch reference on CPU (``pool.kernel_backend``, "auto" by
default).  The host-side lengths SGLang already holds bound the kernels'
grids, so no pass synchronises on device lengths.

**CUDA graphs (decode).**  SGLang's decode graph runner
(``model_executor/runner/decode_cuda_graph_runner.py``) calls
:meth:`~OscarInt2AttnBackend.init_cuda_graph_state` once, then per captured
batch size ``bs`` :meth:`~OscarInt2AttnBackend.init_forward_metadata_out_graph`
with ``in_capture=True`` before recording the forward, and before every replay
``init_forward_metadata_out_graph(view)`` with a view of its padded static
buffers (``req_pool_indices`` padded with 0, the runner's reserved request
row; ``seq_lens`` padded with :meth:`get_cuda_graph_seq_len_fill_value`) and
the batch's own, unpadded ``out_cache_loc``.  What is recorded, at the padded
batch, is first the hot side pool's update (``HotSet.begin_pass``, in
:meth:`~OscarInt2AttnBackend.init_forward_metadata_in_graph`, which SGLang
records before the layers) from the runner's static ``out_cache_loc``,
``req_pool_indices`` and ``seq_lens``, the padded rows (``out_cache_loc`` 0,
SGLang's padding slot) masked out so they never touch the hot pool, its
``hot_loc`` written to a static buffer; then the per-layer work of
:meth:`forward_decode` (write path, query rotation, split-K decode kernel,
de-rotation) reading that buffer; the split count is fixed per ``bs`` at
capture (empty splits cost one early exit).  The padded rows' ``hot_loc`` is
-1, so they write INT2 rows to the padding slot 0 (as every SGLang backend's
padded rows do).  Nothing runs eagerly before a replay: the host launches one
graph per step.  With ``OSCAR_SGLANG_GRAPH_HOT_UPDATE=eager`` (the way back if
recording the update fails on some GPU) the update runs eagerly before each
replay instead, for the live rows only, and its ``hot_loc`` is copied into the
static buffer.  Prefill (extend) always runs eagerly.

**Overlap scheduling.**  With SGLang's overlap scheduler on a GPU, the
scheduler prepares the next batch on its own CUDA stream while this one runs:
it frees the rows of requests that ended (our ``end_requests`` hook), writes
``req_to_token`` rows for new requests (often into rows just freed, whose old
requests are still in the running batch for one discarded step) and new
positions of running ones.  Its write-after-read barrier waits only for where
the backend says its reads of such scheduler-written tables end
(:meth:`~OscarInt2AttnBackend.shared_read_ends`): for decode graphs, the end of
``init_forward_metadata_in_graph`` (SGLang records its marker right after it),
not the end of the forward.  So every such read of a decode graph is in that
prep: the hot pool's update (which reads ``req_to_token``) and a copy of the
batch's ``req_to_token`` rows into a static page table, which the layers read
instead of the live table.  What ``end_requests`` writes meanwhile (stamps of
out-of-window entries) no layer reads; and since the scheduler frees rows
(``process_batch_result``) on its stream only after waiting for that marker
(``Scheduler._apply_war_barrier`` in 0.5.23's overlap loop), its zeroing of an
ended request's length lands after the discarded step's update has written
it, so that step cannot make the ended row look live again.  Eager passes
(prefill, decode without a graph) are fenced by SGLang as a whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend, SharedReadEnds
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from oscar_sglang.kernels import api as kernels

from .pool import OscarInt2Pool
from .settings import decode_kernel_autotuned, decode_kernel_options, extend_path, graph_hot_update


_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)
logger = logging.getLogger(__name__)


@dataclass
class ForwardMetadata:
    """Per-pass state shared by all layers."""

    hot_loc: torch.Tensor            # [new tokens] hot entry or -1
    prefix_lens: torch.Tensor | None  # [batch] extend only, on the device
    extend_lens: torch.Tensor | None  # [batch] extend only, on the device
    max_len: int                      # longest sequence (decode) or extension (extend), from host lists
    max_prefix: int = 0               # longest cached prefix (extend), from host lists: lets extend split it
    num_splits: int | None = None     # decode split count fixed for a CUDA graph (None: chosen per pass)
    pages: torch.Tensor | None = None      # CUDA graph decode: the batch's req_to_token rows, copied in the
    page_rows: torch.Tensor | None = None  # in-graph prep, and their rows 0..bs-1 (None: req_to_token itself)


# Padded rows of a graph batch attend to one token: req_to_token's reserved row 0 points at slot 0,
# the padding slot, which is a valid row of every store (SGLang's triton backend uses 1 too).
SEQ_LEN_FILL_VALUE = 1


class OscarInt2AttnBackend(AttentionBackend):
    """Extend and decode attention over :class:`OscarInt2Pool`."""

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarInt2Pool):
            raise RuntimeError(f"the oscar_int2 attention backend needs --kv-cache-dtype oscar-int2 "
                               f"(the KV pool is a {type(pool).__name__})")
        self.pool = pool
        # what SGLang's forward_context.get_token_to_kv_pool / get_req_to_token_pool read from the backend
        self.token_to_kv_pool, self.req_to_token_pool = pool, model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = model_runner.device
        self.forward_metadata = None
        self._checked_layers: set[int] = set()
        self._graph_hot_loc: torch.Tensor | None = None   # static hot_loc of captured decode graphs
        self._graph_pages: torch.Tensor | None = None     # static copy of the graph batch's req_to_token rows
        self._graph_rows: torch.Tensor | None = None      # 0..max_bs-1: the rows of that copy
        self._graph_splits: dict[int, int | None] = {}
        self._hot_in_graph = True                           # the hot pool's update recorded in the graphs
        # OSCAR_SGLANG_EXTEND_KERNEL: "sdpa" (the default on CUDA), or the kernel with its tile and dots
        self._extend_backend, self._extend_options = extend_path(torch.device(self.device).type)
        self._decode_options = decode_kernel_options()      # OSCAR_SGLANG_DECODE_KERNEL: tile, if set
        # where every request's hot rows are (its sink and recent windows): the decode's splits cut by work
        self._hot_windows = (self.pool.hot.sink, self.pool.hot.recent)
        self.decode_choice = None                           # the startup timing's Choice, where it ran
        if decode_kernel_autotuned() and torch.device(self.device).type == "cuda" and self._uses_triton():
            self.decode_choice = tuned_decode_choice(self.pool, lambda: _query_heads(model_runner))
        if self._extend_backend or self._extend_options or self._decode_options:
            logger.info("oscar_int2 attention: extend %s; decode %s",
                        "through the sdpa path (kernels/extend/sdpa.py)" if self._extend_backend
                        else f"kernel options {self._extend_options or 'default'}",
                        "as timed at startup (the 'decode loop' line)" if self.decode_choice is not None
                        else f"kernel options {self._decode_options or 'default'}")

    # -- per pass -------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        """Once per pass: the hot side pool's update, from SGLang's device tensors (no loop, no sync)."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_decode():
            plan_seq = forward_batch.seq_lens
            plan_prefix = plan_seq - 1                       # one new token per request
            prefix_t = extend_t = None
            max_len = _host_max(forward_batch.seq_lens_cpu, plan_seq)
            max_prefix = 0
        elif mode in _EXTEND_MODES:
            prefix_t, extend_t = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            plan_prefix, plan_seq = prefix_t, prefix_t + extend_t
            max_len = _host_max(forward_batch.extend_seq_lens_cpu, extend_t)
            max_prefix = _host_max(forward_batch.extend_prefix_lens_cpu, prefix_t)
        else:
            raise NotImplementedError(f"the oscar_int2 attention backend does not serve forward mode {mode.name}")
        hot_loc = self.pool.begin_pass(forward_batch.out_cache_loc, forward_batch.req_pool_indices, plan_prefix,
                                       plan_seq, self.req_to_token, decode=mode.is_decode())
        self.forward_metadata = ForwardMetadata(hot_loc, prefix_t, extend_t, max_len, max_prefix)

    # -- CUDA graphs (decode) ---------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        """Once, before capture: the static buffers every captured decode graph reads.

        ``hot_loc`` and the page-table copy: ``max_bs`` rows of ``req_to_token``
        (``max_bs * max context * 4`` bytes, the size of SGLang's triton
        backend's ``cuda_graph_kv_indices``).
        """
        device = torch.device(self.device)
        if device.type == "cuda" and not self._uses_triton():
            raise RuntimeError("oscar-int2: CUDA graphs need the Triton kernels, and this model's shape falls back "
                               "to the plain-torch path (see the startup warning); pass --disable-cuda-graph")
        self._graph_hot_loc = torch.full((max(max_bs, max_num_tokens),), -1, dtype=torch.long, device=device)
        self._graph_pages = torch.zeros((max_bs, self.req_to_token.shape[1]), dtype=self.req_to_token.dtype,
                                        device=device)
        self._graph_rows = torch.arange(max_bs, dtype=torch.long, device=device)
        self._graph_splits.clear()
        self._hot_in_graph = graph_hot_update() == "graph"

    def get_cuda_graph_seq_len_fill_value(self):
        return SEQ_LEN_FILL_VALUE

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before capturing a decode graph (``in_capture``) or replaying one: see the module docstring.

        Capture: the padded batch's metadata points at the static buffer, all
        -1.  Replay: nothing to do (the update is recorded in the graph), or,
        with the eager hot update, the hot pool's update for the live rows
        (fixed sequence of tensor ops, no host sync), its ``hot_loc`` copied
        into the static buffer and the padded rows' entries reset to -1.  The
        live rows are the first ``out_cache_loc.numel()`` rows (one new token
        each).
        """
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            raise NotImplementedError(f"the oscar_int2 attention backend captures CUDA graphs for decode only, "
                                      f"not {mode.name}")
        if self._graph_hot_loc is None:
            raise RuntimeError("init_cuda_graph_state was not called before the CUDA graph metadata")
        eager_update = not in_capture and not self._hot_in_graph
        if eager_update and _stream_capturing(self.device):
            # e.g. SGLANG_ENABLE_METADATA_GLUE_GRAPH: the eager update reads the batch's own out_cache_loc (a
            # new tensor every step), so it must not be recorded; the glue graph then falls back to eager.
            raise RuntimeError("the oscar_int2 backend's eager hot pool update cannot be captured")
        bs = forward_batch.req_pool_indices.shape[0]
        static = self._graph_hot_loc[:bs]
        if in_capture:
            static.fill_(-1)
        elif eager_update:
            loc = forward_batch.out_cache_loc
            live = loc.numel()
            if live:
                rows, seq = forward_batch.req_pool_indices[:live], forward_batch.seq_lens[:live]
                hot_loc = self.pool.begin_pass(loc, rows, seq - 1, seq, self.req_to_token, decode=True)
                static[:live].copy_(hot_loc)
            if live < bs:
                static[live:].fill_(-1)
        self.forward_metadata = ForwardMetadata(static, None, None, self.req_to_token.shape[1],
                                                num_splits=self._splits_for_graph(bs),
                                                pages=self._graph_pages[:bs], page_rows=self._graph_rows[:bs])

    def init_forward_metadata_in_graph(self, forward_batch):
        """Recorded at the start of a decode graph, before the layers: every read of a table the scheduler
        writes (module docstring, "Overlap scheduling").

        The batch's ``req_to_token`` rows are copied into the static page
        table the layers read, then the hot pool is updated.  Reads the
        runner's static buffers of the padded batch (``forward_batch`` is the
        capture's); a row is live where ``out_cache_loc`` is not 0, SGLang's
        padding slot, which no request's token ever occupies.
        """
        rows = forward_batch.req_pool_indices
        torch.index_select(self.req_to_token, 0, rows, out=self.forward_metadata.pages)
        if not self._hot_in_graph:
            return
        loc, seq = forward_batch.out_cache_loc, forward_batch.seq_lens
        hot_loc = self.pool.begin_pass(loc, rows, seq - 1, seq, self.req_to_token, decode=True, live=loc != 0)
        self.forward_metadata.hot_loc.copy_(hot_loc)

    def shared_read_ends(self, fm) -> SharedReadEnds:
        """Where the reads of scheduler-written tables end (module docstring, "Overlap scheduling").

        Decode: in the graph's prep (:meth:`init_forward_metadata_in_graph`);
        an eager decode is fenced whole by SGLang anyway.  Extend: unknown, so
        SGLang fences the whole pass (the layers read ``req_to_token``).
        """
        return SharedReadEnds.IN_REPLAY if fm.is_decode() else SharedReadEnds.UNKNOWN

    def _uses_triton(self) -> bool:
        backend = self.pool.kernel_backend
        return backend == "triton" or (backend == "auto" and torch.device(self.device).type == "cuda")

    def _decode_options_for(self, bs: int) -> dict:
        """The decode kernel's options for a batch of ``bs`` requests: the startup timing's pick for that batch
        size where it ran (``Choice.options_for``), else the knob's (``{}``: the kernel's defaults)."""
        return self.decode_choice.options_for(bs) if self.decode_choice is not None else self._decode_options

    def _splits_for_graph(self, bs: int) -> int | None:
        """Decode splits of a captured batch size: as many as the longest context could use (fixed per ``bs``)."""
        if bs not in self._graph_splits:
            splits = None
            if self._uses_triton():
                from oscar_sglang.kernels.decode.triton_kernel import choose_splits

                tile = {k: v for k, v in self._decode_options_for(bs).items()  # the knob's or the timing's
                        if k in ("block_n", "num_warps", "resident")}
                splits = choose_splits(bs, self.pool.head_num, torch.device(self.device),
                                       max_seq_len=self.req_to_token.shape[1], **tile)
            self._graph_splits[bs] = splits
        return self._graph_splits[bs]

    # -- per layer ------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer)
        q3, k3, v3 = self._shape(q, k, v, layer)
        self._save(layer, forward_batch, k3, v3, save_kv_cache)
        store, rot = self.pool.layer(layer.layer_id)
        md = self.forward_metadata
        o = kernels.extend_attention(q3, k3, v3, store, rot, self.req_to_token, forward_batch.req_pool_indices,
                                     md.prefix_lens, md.extend_lens, layer.scaling,
                                     backend=self._extend_backend or self.pool.kernel_backend,
                                     max_extend_len=md.max_len,
                                     max_prefix_len=md.max_prefix, **self._extend_options)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer)
        q3, k3, v3 = self._shape(q, k, v, layer)
        self._save(layer, forward_batch, k3, v3, save_kv_cache)
        store, rot = self.pool.layer(layer.layer_id)
        md = self.forward_metadata
        tuning = {"max_seq_len": md.max_len} if md.num_splits is None else {"num_splits": md.num_splits}
        pages, rows = ((self.req_to_token, forward_batch.req_pool_indices) if md.pages is None
                       else (md.pages, md.page_rows))
        o = kernels.decode_attention(q3, store, rot, pages, rows, forward_batch.seq_lens, layer.scaling,
                                     backend=self.pool.kernel_backend, **tuning, hot_windows=self._hot_windows,
                                     **self._decode_options_for(q3.shape[0]))
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def support_triton(self):
        return False

    # -- helpers --------------------------------------------------------------

    def _save(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            # The pass already gave the new tokens BF16 entries (shared by all layers): skipping this layer's
            # write would leave it reading another slot's rows there.  Models known to do this are refused
            # at startup (compat.ARCHITECTURE_REFUSALS); this is the safety net for any other.
            raise RuntimeError(f"--kv-cache-dtype oscar-int2: layer {layer.layer_id} of this model attends "
                               "without writing its K/V (save_kv_cache=False), which the INT2 cache does not "
                               "support; serve this model with SGLang's own KV cache")
        self.pool.write(layer.layer_id, forward_batch.out_cache_loc, k, v, self.forward_metadata.hot_loc)

    @staticmethod
    def _shape(q, k, v, layer):
        if k is None or v is None:
            raise NotImplementedError("the oscar_int2 attention backend needs the new tokens' K and V")
        d = layer.qk_head_dim
        return (q.reshape(-1, layer.tp_q_head_num, d), k.reshape(-1, layer.tp_k_head_num, d),
                v.reshape(-1, layer.tp_v_head_num, d))

    def _check_layer(self, layer) -> None:
        if layer.layer_id in self._checked_layers:
            return
        problems = []
        if layer.qk_head_dim != layer.v_head_dim:
            problems.append("different K and V head dims")
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            problems.append("non-causal or cross attention")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            problems.append("sliding-window attention")
        if layer.logit_cap and layer.logit_cap > 0:
            problems.append("attention logit soft-capping")
        if problems:
            raise NotImplementedError(f"the oscar_int2 attention backend does not support layer {layer.layer_id}: "
                                      + ", ".join(problems))
        self._checked_layers.add(layer.layer_id)


# (device, query heads, KV heads, head size, K and V formats) -> the timing's Choice: one timing per process
_TUNED: dict[tuple, object] = {}


def tuned_decode_choice(pool: OscarInt2Pool, query_heads):
    """The decode loop timed on this GPU (``kernels/decode/autotune.py``: a ``Choice``, whose ``options_for(bs)``
    the backend serves) for ``pool``'s most common layer formats and ``query_heads()`` query heads per rank,
    logged in one line; None (the kernel's defaults) with a warning if the timing fails: a server never fails
    to start for it.  Once per process and shape (a second backend of the same model reuses it)."""
    try:
        from oscar_sglang.kernels.decode.autotune import choose

        q_heads = query_heads()
        formats = [(lf.k, lf.v) for lf in pool.layer_formats]
        common = max(formats, key=formats.count)     # the first of the most common
        store, rot = pool.layer(pool.start_layer + formats.index(common))
        windows = (pool.hot.sink, pool.hot.recent)
        key = (str(store.k_codes.device), q_heads, pool.head_num, pool.head_dim, common, windows)
        if key not in _TUNED:
            choice = choose(store, rot, q_heads, windows=windows)
            logger.info("oscar_int2 %s", choice.summary())
            _TUNED[key] = choice
        return _TUNED[key]
    except Exception as e:  # noqa: BLE001
        logger.warning("oscar_int2: timing the decode loop's candidates failed (%s: %s); serving with the "
                       "kernel's defaults", type(e).__name__, str(e)[:200])
        return None


def _query_heads(model_runner) -> int:
    """Query heads of one attention-tensor-parallel rank."""
    from sglang.srt.runtime_context import get_parallel

    return model_runner.model_config.get_num_attention_heads(get_parallel().attn_tp_size)


def _host_max(host, device_tensor: torch.Tensor) -> int:
    """Largest length from SGLang's host copy (a list or CPU tensor); the device tensor (a sync) only without one."""
    if host is None:
        host = device_tensor
    if isinstance(host, torch.Tensor):
        return int(host.max()) if host.numel() else 0
    return max(host, default=0)


def _stream_capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def create_backend(model_runner) -> OscarInt2AttnBackend:
    """Factory registered with SGLang's attention registry."""
    return OscarInt2AttnBackend(model_runner)
