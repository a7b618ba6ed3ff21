"""The INT2 server under SGLang's real scheduling: page sizes, chunked prefill, retraction (CPU, real servers).

The long form (``--slow``, ~3 minutes on two cores): its fast form, one server
with page size 16, chunked prefill and forced retraction at a wide window
against the BF16 server, is in ``test_sglang_server.py``.

Four oscar-int2 servers with the same Hadamard rotations, started one after
the other, each answering and stopping before the next starts:

* **reference** (page size 1, sink 4 / recent 16): 8 short prompts one at a time;
* **page 64 + retraction** (``--page-size 64``, sink 4 / recent 16, and
  SGLang's own retraction test switch ``SGLANG_TEST_RETRACT=1``: every third
  forward pass retracts running decode requests, which are re-admitted later
  and prefill again): the 8 prompts at once, then one probe after a flush;
* **one piece, wide window** (page size 1, sink 4 / recent 512): long prompts
  (~450 tokens) prefilled in one piece;
* **chunked, wide window** (``--page-size 16 --chunked-prefill-size 64``,
  recent 512): the same long prompts in 7+ chunks.

Every answer must repeat its reference's greedy tokens up to float noise
(``test_sglang_server._same_up_to_noise``: log probabilities within 0.4 nats
on the common tokens; a first difference only at a near-tie).  The chunked
pair runs with a window wider than the prompts so that every read of an
earlier chunk is a BF16 row, as in one piece: then chunking must not change
the answer, and an off-by-one in the extend over a cached prefix, the hot
window plan across chunks or the page-16 slot mapping would.  With a narrow
window, later chunks read the earlier chunks' K/V in INT2 while one piece
reads them exactly: a difference by design (METHOD.md), not asserted (with
recent 16 and Hadamard rotations the first long prompt's answer differed from
its first token, top-2 margin 1.06 nats, 2026-12-01; docs/SGLANG.md).  After
the traffic and a cache flush, one request must hold exactly its own window
in the hot pool (the pool's log line): no entry of a freed or retracted
request survives in window.
"""

import re

import pytest
from test_sglang_server import CHUNK, CONCURRENT, LONG, N_LONG, RECENT, SINK, _generate, _same_up_to_noise
from test_sglang_server import WIDE as WIDE_RECENT
from test_sglang_server import retracting_env

from oscar_sglang.sglang.launcher import flush_cache, local_server
from oscar_sglang.sglang.metrics import log_lines

pytestmark = [pytest.mark.server, pytest.mark.model, pytest.mark.slow]

BASE = ("--max-total-tokens", "4096", "--kv-cache-dtype", "oscar-int2", "--oscar-sink", str(SINK),
        "--decode-log-interval", "4")
NARROW = ("--oscar-recent", str(RECENT))
WIDE = ("--oscar-recent", str(WIDE_RECENT))
BATCH = CONCURRENT[2:10]   # 8 short prompts (23-31 tokens) served at once under retraction
N_BATCH = 16               # greedy tokens per answer


@pytest.fixture(scope="module")
def model_dir():
    from oscar_sglang import assets

    return assets.default_model_dir()


@pytest.fixture(scope="module")
def rotations(model_dir, tmp_path_factory):
    from transformers import AutoConfig

    from oscar_sglang import artifacts

    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))
    return artifacts.save(artifacts.hadamard(fp), tmp_path_factory.mktemp("rot") / "hadamard")


def _one_at_a_time(url, prompts, n):
    out = []
    for p in prompts:
        flush_cache(url)
        out.append(_generate(url, p, n))
    return out


@pytest.fixture(scope="module")
def reference(model_dir, rotations, tmp_path_factory):
    log = tmp_path_factory.mktemp("ref") / "server.log"
    with local_server(model_dir, log, *BASE, *NARROW, "--oscar-rotations", str(rotations)) as url:
        return {"batch": _one_at_a_time(url, BATCH, N_BATCH)}


@pytest.fixture(scope="module")
def page64_retracted(model_dir, rotations, reference, tmp_path_factory):
    import concurrent.futures

    log = tmp_path_factory.mktemp("p64") / "server.log"
    with local_server(model_dir, log, *BASE, *NARROW, "--oscar-rotations", str(rotations), "--page-size", "64",
                      env=retracting_env()) as url:
        flush_cache(url)
        with concurrent.futures.ThreadPoolExecutor(len(BATCH)) as pool:
            batch = list(pool.map(lambda p: _generate(url, p, N_BATCH), BATCH))
        flush_cache(url)
        before = len(log_lines(log))
        _generate(url, BATCH[0], 12)
        return {"batch": batch, "log": log, "probe_lines": log_lines(log)[before:]}


@pytest.fixture(scope="module")
def one_piece_wide(model_dir, rotations, page64_retracted, tmp_path_factory):
    log = tmp_path_factory.mktemp("wide") / "server.log"
    with local_server(model_dir, log, *BASE, *WIDE, "--oscar-rotations", str(rotations)) as url:
        return _one_at_a_time(url, LONG, N_LONG)


@pytest.fixture(scope="module")
def chunked(model_dir, rotations, one_piece_wide, tmp_path_factory):
    log = tmp_path_factory.mktemp("chunked") / "server.log"
    with local_server(model_dir, log, *BASE, *WIDE, "--oscar-rotations", str(rotations), "--page-size", "16",
                      "--chunked-prefill-size", str(CHUNK)) as url:
        return _one_at_a_time(url, LONG, N_LONG)


def test_page_size_64_under_retraction_answers_like_page_size_1(reference, page64_retracted):
    text = page64_retracted["log"].read_text()
    assert re.search(r"retract", text, re.IGNORECASE), "SGLang never retracted a request"
    for ref, got in zip(reference["batch"], page64_retracted["batch"]):
        assert got["completion_tokens"] == N_BATCH and got["prompt_tokens"] == ref["prompt_tokens"]
        _same_up_to_noise(ref, got, "page 64, retracted and resumed vs page 1 one at a time")


def test_no_hot_entry_of_a_freed_or_retracted_request_stays_in_window(page64_retracted):
    lines = page64_retracted["probe_lines"]
    assert lines, "no hot pool line at the decode log interval"
    assert lines[-1]["in_window"] == SINK + RECENT, lines[-1]


def test_chunked_prefill_answers_like_one_piece(one_piece_wide, chunked):
    moved = []
    for ref, got in zip(one_piece_wide, chunked):
        assert got["prompt_tokens"] == ref["prompt_tokens"] > 5 * CHUNK
        n, dlp = _same_up_to_noise(ref, got, "chunked prefill (page 16) vs one piece (page 1)")
        moved.append((n, round(dlp, 3)))
    print(f"\nchunked vs one piece, wide window (leading equal tokens, largest log-prob move): {moved}")
