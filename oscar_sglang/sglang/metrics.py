"""What the hot side pool is doing, at SGLang's decode log interval: one log line and Prometheus metrics.

Hooked after ``SchedulerMetricsReporter.report_decode_stats``: every
``--decode-log-interval`` decode passes (where SGLang logs its "Decode batch"
line), each scheduler with the INT2 pool reads the hot set's counters (one
device sync, as SGLang's own line makes) and

* logs ``oscar-int2 hot pool: ...`` (entries in window / out of window / free,
  in-window evictions and denied window tokens so far, the share of the
  current decode batch's attention reads served from BF16);
* with ``--enable-metrics``, sets these Prometheus series (SGLang's labels):

  ==========================================  =======  ==============================================
  ``sglang:oscar_hot_entries``                gauge    entries of the BF16 side pool (both regions)
  ``sglang:oscar_hot_in_window_entries``      gauge    entries holding a token in a live request's window
  ``sglang:oscar_hot_out_of_window_entries``  gauge    entries holding a copy outside every live window
  ``sglang:oscar_hot_in_window_evictions``    counter  in-window entries taken for another token (that
                                                       token is read from INT2 from then on)
  ``sglang:oscar_hot_denied_tokens``          counter  window tokens that got no entry
  ``sglang:oscar_bf16_read_share``            gauge    share of the logged decode batch's attention reads
                                                       (tokens x requests) served from BF16 rows
  ==========================================  =======  ==============================================

Counters are ``_total`` in Prometheus' text format.  Plain torch apart from the hook.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GAUGES = ("oscar_hot_entries", "oscar_hot_in_window_entries", "oscar_hot_out_of_window_entries",
          "oscar_bf16_read_share")
COUNTERS = ("oscar_hot_in_window_evictions", "oscar_hot_denied_tokens")
_HELP = {
    "oscar_hot_entries": "Entries of the oscar-int2 BF16 hot side pool",
    "oscar_hot_in_window_entries": "Hot side pool entries holding a token in a live request's sink or recent window",
    "oscar_hot_out_of_window_entries": "Hot side pool entries holding a BF16 copy outside every live window",
    "oscar_bf16_read_share": "Share of the logged decode batch's attention reads served from BF16 rows",
    "oscar_hot_in_window_evictions": "In-window hot entries taken for another token (read from INT2 from then on)",
    "oscar_hot_denied_tokens": "Window tokens that got no hot entry (side pool too small for the pass)",
}


def bf16_reads(hot_index: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
               chunk_rows: int = 16) -> tuple[int, int]:
    """``(reads served from BF16, all reads)`` of one decode step over ``rows`` of lengths ``seq_lens``.

    A request of length ``n`` reads its ``n`` cached tokens; a read is BF16
    where the token's slot holds a hot entry.  Chunked over rows to bound the
    temporary index (syncs: for logging, not the per-pass path).
    """
    hot = total = 0
    for i in range(0, rows.numel(), chunk_rows):
        r, n = rows[i:i + chunk_rows].long(), seq_lens[i:i + chunk_rows].long()
        if r.numel() == 0:
            continue
        width = int(n.max())
        if width == 0:
            continue
        pos = torch.arange(width, device=req_to_token.device)
        slots = req_to_token[r.unsqueeze(1), pos.clamp(max=req_to_token.shape[1] - 1)]
        live = pos < n.unsqueeze(1)
        hot += int(((hot_index[slots.long()] >= 0) & live).sum())
        total += int(n.sum())
    return hot, total


class HotPoolMetrics:
    """The Prometheus series of one scheduler (created on first use, with SGLang's labels)."""

    def __init__(self, labels: dict[str, str], registry=None):
        from prometheus_client import Counter, Gauge

        names = sorted(labels)
        kw = {} if registry is None else {"registry": registry}       # default: the process's registry
        self.labels = labels
        self.gauges = {g: Gauge(f"sglang:{g}", _HELP[g], labelnames=names, multiprocess_mode="mostrecent", **kw)
                       for g in GAUGES}
        self.counters = {c: Counter(f"sglang:{c}", _HELP[c], labelnames=names, **kw) for c in COUNTERS}
        for c in self.counters.values():          # exported from the start (at 0), not after the first loss
            c.labels(**labels)
        self._last = {c: 0 for c in COUNTERS}

    def update(self, snapshot: dict) -> None:
        for g in GAUGES:
            self.gauges[g].labels(**self.labels).set(snapshot[g])
        for c in COUNTERS:
            delta = snapshot[c] - self._last[c]
            if delta > 0:
                self.counters[c].labels(**self.labels).inc(delta)
            self._last[c] = snapshot[c]


def batch_rows(batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(req_to_token rows, cached lengths)`` of a ScheduleBatch's requests (from ``reqs``: its tensors may be
    stale or unset between passes), or of any object with ``req_pool_indices``/``seq_lens`` tensors."""
    reqs = getattr(batch, "reqs", None)
    if reqs:
        kv = [r.kv for r in reqs if getattr(r.kv, "req_pool_idx", None) is not None]
        return (torch.tensor([k.req_pool_idx for k in kv], dtype=torch.long),
                torch.tensor([k.kv_committed_len for k in kv], dtype=torch.long))
    rows, lens = getattr(batch, "req_pool_indices", None), getattr(batch, "seq_lens", None)
    return None if rows is None or lens is None else (rows, lens)


def snapshot(pool, batch=None, req_to_token: torch.Tensor | None = None) -> dict:
    """The hot set's state and, given a decode ``batch``, the BF16 share of its reads."""
    c = pool.hot.counters
    out = {"oscar_hot_entries": pool.hot.entries, "oscar_hot_in_window_entries": c["in_window"],
           "oscar_hot_out_of_window_entries": c["out_of_window"],
           "oscar_hot_in_window_evictions": c["in_window_evictions"], "oscar_hot_denied_tokens": c["denied"],
           "oscar_bf16_read_share": 0.0, "reads": (0, 0)}
    got = batch_rows(batch) if batch is not None else None
    if got is not None and req_to_token is not None and got[0].numel():
        rows, lens = (t.to(req_to_token.device) for t in got)
        hot, total = bf16_reads(pool.hot_index, req_to_token, rows, lens)
        out["reads"] = (hot, total)
        out["oscar_bf16_read_share"] = hot / total if total else 0.0
    return out


def log_line(s: dict) -> str:
    hot, total = s["reads"]
    return (f"oscar-int2 hot pool: {s['oscar_hot_in_window_entries']}/{s['oscar_hot_entries']} entries in window, "
            f"{s['oscar_hot_out_of_window_entries']} out of window; in-window evictions "
            f"{s['oscar_hot_in_window_evictions']}, denied window tokens {s['oscar_hot_denied_tokens']}; "
            f"BF16 reads {hot}/{total} ({100 * s['oscar_bf16_read_share']:.1f} %) in this decode batch")


_LOG_LINE = re.compile(r"oscar-int2 hot pool: (\d+)/(\d+) entries in window, (\d+) out of window; in-window "
                       r"evictions (\d+), denied window tokens (\d+); BF16 reads (\d+)/(\d+)")
LOG_FIELDS = ("in_window", "entries", "out_of_window", "in_window_evictions", "denied", "bf16_reads", "reads")


def log_lines(log_path) -> list[dict[str, int]]:
    """Every hot-pool line (:func:`log_line`) in a server log, parsed: ``{field: int}`` per ``LOG_FIELDS``."""
    text = Path(log_path).read_text(errors="replace")
    return [dict(zip(LOG_FIELDS, map(int, m.groups()))) for m in _LOG_LINE.finditer(text)]


def report_decode_stats(result, reporter, *args, **kwargs):
    """After ``SchedulerMetricsReporter.report_decode_stats``: at its log interval, the hot pool's line and metrics."""
    interval = getattr(reporter, "decode_log_interval", 0)
    if not interval or reporter.forward_ct_decode % interval != 0:
        return result
    logging_rank = getattr(reporter, "is_stats_logging_rank", False)
    metrics_on = getattr(reporter, "current_scheduler_metrics_enabled", False)
    if not (logging_rank or metrics_on):
        return result
    scheduler = reporter.scheduler
    req_pool = getattr(scheduler, "req_to_token_pool", None)
    pool = getattr(req_pool, "oscar_pool", None)
    if pool is None:
        return result
    batch = kwargs.get("running_batch") or (args[1] if len(args) > 1 else None) or scheduler.running_batch
    s = snapshot(pool, batch, req_pool.req_to_token)
    if logging_rank:
        logger.info(log_line(s))
    if metrics_on:
        metrics = getattr(reporter, "_oscar_metrics", None)
        if metrics is None:
            labels = dict(getattr(reporter.metrics_collector, "labels", None) or {})
            metrics = reporter._oscar_metrics = HotPoolMetrics(labels)
        metrics.update(s)
    return result
