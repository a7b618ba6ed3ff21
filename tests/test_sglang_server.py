"""End to end on the real SGLang server, on CPU: the INT2 cache answers like BF16 and refuses bad artifacts.

Servers (SmolLM2-135M, ``--max-total-tokens 2048``, on a free port of
127.0.0.1, started one at a time through :mod:`oscar_sglang.sglang.launcher`,
whose teardown kills each server's whole process group):

* a BF16 server, which answers every prompt once and stops;
* (``--slow`` only) an oscar-int2 server with an artifact calibrated by
  ``oscar-calibrate`` in the fixture (oscar-center, 2048 tokens, its default
  precision policy; ~90 s on two cores), which answers the same factual
  prompts and stops;
* an oscar-int2 server under SGLang's scheduling (page size 16, chunked
  prefill of 64 tokens, SGLang's forced retraction, a Hadamard artifact with
  mixed per-layer formats), its prefill through the sdpa path (the default on
  CUDA; ``OSCAR_SGLANG_EXTEND_KERNEL=sdpa``), and a window wider than its
  prompts, so that every read is a BF16 row: a long prompt in chunks and the
  factual prompts at once must answer like the BF16 server (the fast form of
  ``test_sglang_scheduling.py``, where the long prompt is also served through
  the torch reference's extend);
* an oscar-int2 server with Hadamard rotations (``--enable-cache-report``,
  ``--enable-metrics``), which stays up for the plugin, prefix-cache,
  concurrency and hot-pool bookkeeping tests.

The calibrated and Hadamard INT2 servers run ``--oscar-sink 4 --oscar-recent
16`` and every prompt is longer than 20 tokens, so most of each prompt is read
back from INT2.  Plus launches that must refuse to start (missing artifacts;
with ``--slow`` also wrong-model and corrupted ones, whose sentences
test_sglang_hooks.py and test_artifacts.py check without a server).  Takes a
few minutes on two cores; select with ``-m server`` or skip with ``-m "not
server"``; ``-s`` shows the measured agreement.

Noise model used by the cache and concurrency tests.  On CPU the GEMMs are not
batch invariant: the same request batched with others (or prefilled as an
extend of one token instead of decoded) gets logits that differ in the last
bits of BF16, and with INT2 a tiny change of K can flip a 2-bit code.  SGLang's
``--enable-deterministic-inference`` does not help here: its batch-invariant
ops register for CUDA/XPU/NPU only (on CPU ``get_dispatch_device_backend``
raises "No supported accelerator"), and it accepts only its listed attention
backends (fa3, flashinfer, triton, ...), not oscar_int2.  Measured on this CPU: the log probabilities of the same greedy tokens
move by at most 0.14 nats (BF16) and 0.19 nats (INT2) between sequential and
16-way concurrent requests, and the answers that differ do so at exact BF16
ties (top-2 margin 0 or 0.125).  On a CPU with native bf16 (AVX-512-BF16,
2026-12-01) single tokens move more, by 0.42 and 0.51 nats (the same at the
commit before the precision policy: the bf16 GEMMs of other batch shapes round
differently there, and an INT2 code on a rounding boundary flips), while the
mean over an answer's tokens stays at most 0.15.  So "equal answers" is
asserted as: the log probabilities along the common tokens within ``NOISE``
(0.4 nats) of the reference on average and within ``NOISE_ONE_TOKEN`` (1 nat)
each, and the first differing token (if any) only where the reference's top-2
margin is below ``2 * NOISE`` -- a near-tie a perturbation of that size can
flip.  A leak between requests, a wrong hot row or a stale cache entry moves
log probabilities by whole nats, token after token, and fails this.
"""

import concurrent.futures
import re
import shutil
import subprocess
import sys
import time

import pytest

from oscar_sglang import artifacts
from oscar_sglang.sglang.launcher import flush_cache, local_server, post, refused

pytestmark = [pytest.mark.server, pytest.mark.model]

REFUSE_TIMEOUT_S = 240
FIRST_TOKENS = 3
SINK, RECENT = 4, 16
SERVER_FLAGS = ("--max-total-tokens", "2048")
INT2_FLAGS = ("--kv-cache-dtype", "oscar-int2", "--oscar-sink", str(SINK), "--oscar-recent", str(RECENT))
NOISE = 0.4  # nats: bound on the mean float noise of log probabilities between batchings (measured <= 0.15)
NOISE_ONE_TOKEN = 1.0  # nats: bound for one token (measured <= 0.19 on AVX2, 0.51 with native bf16)
AGREE_TOKENS = 8  # greedy tokens compared with BF16 on the factual prompts
NEW_TOKENS = 12  # tokens of the cache and concurrency requests
LOG_INTERVAL = 4  # --decode-log-interval of the Hadamard server: the hot pool's log line and metrics

# Prompts longer than sink + recent (20 tokens), so decoding reads INT2 rows.
PROMPTS = [
    "Here are some facts about geography. The longest river in Africa is the Nile. The tallest mountain in "
    "the world is Mount Everest. The largest ocean on Earth is the Pacific Ocean. The capital city of Japan is",
    "Question: What is the chemical symbol for gold, and what is its atomic number? Please answer in one "
    "sentence and explain briefly where the symbol comes from.\nAnswer:",
]
# Short factual prompts (23-31 tokens) for the agreement counts of the calibrated artifact.
FACTS = [
    "Albert Einstein was a theoretical physicist who developed the theory of relativity. He was born in the "
    "German city of Ulm in the year",
    "Mercury is the planet closest to the Sun, and Venus is the second. The third planet from the Sun, on "
    "which we live, is called",
    "William Shakespeare wrote many famous plays, among them Hamlet, Macbeth and Othello. He was born in the "
    "English town of",
    "Our solar system has eight planets. The largest of them, a gas giant with a great red spot, is called",
    "Dogs and cats are the most popular pets in the world. A young dog is called a puppy, and a young cat is "
    "called a",
    "Sound travels through air at about 343 metres per second, much slower than light. During a thunderstorm "
    "you therefore see the lightning before you hear the",
    "Tokyo, Paris and London are among the largest cities in the world. The capital of Italy, famous for the "
    "Colosseum, is",
    "Every year has twelve months. The month that comes after March and before May, when spring flowers bloom "
    "in Europe, is",
]
# 16 distinct prompts for the concurrency test; no two share a first token, so after a cache flush no
# request can hit another's prefix (asserted through cached_tokens == 0).
CONCURRENT = PROMPTS + FACTS + [
    "The French Revolution began in 1789 with the storming of the Bastille, a fortress and prison in Paris. "
    "Over the next decade, the revolutionaries abolished the monarchy and",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. The green pigment that absorbs the light is called",
    "Water boils at 100 degrees Celsius at sea level, but at the top of a high mountain the air pressure is "
    "lower, so water boils at a",
    "In Python, a list comprehension is a compact way to build a list from an iterable. For example, to get "
    "the squares of the numbers from zero to nine you can write",
    "Gold, silver and copper are metals that conduct electricity well. The metal that is liquid at room "
    "temperature and was used in thermometers is",
    "Bees collect nectar from flowers and turn it into a sweet food that people like to spread on bread. This "
    "food is called",
]
# A long shared prefix (~90 tokens) for the prefix-cache test.
LONG_PREFIX = " ".join(CONCURRENT[13:16]) + " "
CHUNK = 64  # --chunked-prefill-size of the scheduling servers
# Long prompts (~450 tokens, 7 chunks of 64): the 16 prompts rotated, so no two start alike.
LONG = [" ".join(CONCURRENT[i:] + CONCURRENT[:i]) for i in (0, 5, 10)]
N_LONG = 10  # greedy tokens per long answer
WIDE = 512  # --oscar-recent wider than every prompt + answer: every read is a BF16 row


# ---------------------------------------------------------------------------
# Requests


def _greedy(url, prompt, max_tokens=8):
    """Greedy answer through the OpenAI-compatible /v1/completions."""
    out = post(url, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "logprobs": 1})
    choice = out["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"], "usage": out["usage"]}


def _generate(url, prompt, n=NEW_TOKENS):
    """Greedy answer of exactly ``n`` tokens through SGLang's native /generate, with top-2 log probabilities.

    ``prompt`` is text or a list of token ids.  Returns the token ids, their log probabilities, the
    top-2 margin at each step, and the prompt/cached/completion token counts of ``meta_info``.
    """
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    body["input_ids" if isinstance(prompt, list) else "text"] = prompt
    out = post(url, "/generate", body)
    meta = out["meta_info"]
    return {"text": out["text"],
            "ids": [t[1] for t in meta["output_token_logprobs"]],
            "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "margins": [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]],
            "prompt_tokens": meta["prompt_tokens"], "cached": meta["cached_tokens"],
            "completion_tokens": meta["completion_tokens"]}


def _leading_agreement(a, b):
    """Number of leading tokens on which two token lists agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _same_up_to_noise(ref, other, what):
    """Assert ``other`` repeats ``ref`` greedily, up to float noise (module docstring).

    Returns the number of leading tokens that agree and the largest log probability change on them.
    """
    n = _leading_agreement(ref["ids"], other["ids"])
    moved = [abs(a - b) for a, b in zip(ref["logprobs"][:n], other["logprobs"][:n])]
    mean = sum(moved) / len(moved) if moved else 0.0
    assert max(moved, default=0.0) < NOISE_ONE_TOKEN and mean < NOISE, (
        f"{what}: log probabilities moved by up to {max(moved, default=0.0):.3f} nats, {mean:.3f} on average, on "
        f"the same tokens (noise bounds {NOISE_ONE_TOKEN} per token, {NOISE} on average): "
        f"{ref['text']!r} vs {other['text']!r}")
    print(f"  {what}: {n} equal leading tokens, log-prob moves up to {max(moved, default=0.0):.3f}, mean {mean:.3f}")
    if n < len(ref["ids"]):
        assert ref["margins"][n] < 2 * NOISE, (
            f"{what}: differs at token {n} where the reference's top-2 margin is {ref['margins'][n]:.3f} "
            f"nats, not a near-tie: {ref['text']!r} vs {other['text']!r}")
    return n, max(moved, default=0.0)


def retracting_env():
    """The server environment with SGLang's own retraction test switch: every third forward pass retracts the
    running decode requests, which are re-admitted later and prefill again."""
    from oscar_sglang.sglang.launcher import server_env

    return {**server_env(), "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"}


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def model_dir():
    from oscar_sglang import assets

    return assets.default_model_dir()


@pytest.fixture(scope="module")
def fingerprint(model_dir):
    from transformers import AutoConfig

    from oscar_sglang import artifacts

    return artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def rotations(fingerprint, tmp_path_factory):
    """A Hadamard artifact for the served model, one calibrated for another model, and a Hadamard one whose
    layers store their rows in different formats (as a precision policy leaves them)."""
    import dataclasses

    from oscar_sglang.format import RowFormat

    root = tmp_path_factory.mktemp("rotations")
    wrong = dataclasses.replace(fingerprint, architecture="Qwen2ForCausalLM", num_layers=28)
    cycle = [artifacts.LayerFormat(RowFormat(4, symmetric=True), RowFormat(2)),
             artifacts.LayerFormat(RowFormat(2, 32), RowFormat(2, symmetric=True)),
             artifacts.LayerFormat(RowFormat(2), RowFormat(8))]
    mixed = artifacts.hadamard(fingerprint).with_formats([cycle[i % 3] for i in range(fingerprint.num_layers)])
    return (artifacts.save(artifacts.hadamard(fingerprint), root / "hadamard"),
            artifacts.save(artifacts.hadamard(wrong), root / "wrong"),
            artifacts.save(mixed, root / "mixed"))


@pytest.fixture(scope="module")
def calibrated(model_dir, tmp_path_factory):
    """An artifact calibrated on real text by the user's command (small: 2048 tokens; ~90 s, most of it the policy).

    Always made here, so the test does not depend on what the quickstart left in rotations/.
    """
    out = tmp_path_factory.mktemp("calibrated") / "oscar-center"
    cmd = [sys.executable, "-m", "oscar_sglang.calibration", "--model", str(model_dir), "--out", str(out),
           "--method", "oscar-center", "--tokens", "2048", "--seq-len", "512", "--sink", str(SINK),
           "--recent", str(RECENT), "--threads", "1", "--quiet"]  # 2 threads: 5x slower on a busy 2-core box
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(f"\ncalibrated {out} in {time.monotonic() - t0:.0f} s")
    return out


@pytest.fixture(scope="module")
def bf16_answers(model_dir, tmp_path_factory):
    """The BF16 server's greedy answers (it stops before any INT2 server starts)."""
    log = tmp_path_factory.mktemp("bf16") / "server.log"
    with local_server(model_dir, log, *SERVER_FLAGS) as url:
        completions = [_greedy(url, p) for p in PROMPTS]
        facts = [_generate(url, p, AGREE_TOKENS) for p in FACTS]
        long = [_generate(url, LONG[0], N_LONG)]
    return {"completions": completions, "facts": facts, "long": long, "stopped_log": log.read_text()}


@pytest.fixture(scope="module")
def calibrated_run(model_dir, calibrated, bf16_answers, tmp_path_factory):
    """Answers of the oscar-int2 server with the calibrated artifact, and its log (it stops afterwards)."""
    log = tmp_path_factory.mktemp("int2-calibrated") / "server.log"
    with local_server(model_dir, log, *SERVER_FLAGS, *INT2_FLAGS, "--oscar-rotations", str(calibrated)) as url:
        cold = []
        for p in FACTS:
            flush_cache(url)
            cold.append(_generate(url, p, AGREE_TOKENS))
        hit = [_generate(url, FACTS[-1], AGREE_TOKENS)]  # the last prompt again: read back from the cache
    return {"cold": cold, "hit": hit, "log": log.read_text(), "dir": calibrated}


@pytest.fixture(scope="module")
def scheduled_run(model_dir, rotations, bf16_answers, tmp_path_factory):
    """The mixed-format INT2 server with page size 16, chunked prefill and SGLang's forced retraction (every
    third forward pass retracts the running decode requests, which prefill again later), its extend passes
    through the sdpa path (OSCAR_SGLANG_EXTEND_KERNEL=sdpa, as on CUDA by default), window WIDE: the long
    prompt in chunks, then the factual prompts all at once (it stops afterwards)."""
    log = tmp_path_factory.mktemp("int2-scheduled") / "server.log"
    with local_server(model_dir, log, "--max-total-tokens", "4096", "--kv-cache-dtype", "oscar-int2",
                      "--oscar-sink", str(SINK), "--oscar-recent", str(WIDE), "--oscar-rotations", str(rotations[2]),
                      "--page-size", "16", "--chunked-prefill-size", str(CHUNK),
                      env={**retracting_env(), "OSCAR_SGLANG_EXTEND_KERNEL": "sdpa"}) as url:
        long = [_generate(url, LONG[0], N_LONG)]
        flush_cache(url)
        with concurrent.futures.ThreadPoolExecutor(len(FACTS)) as pool:
            batch = list(pool.map(lambda p: _generate(url, p, AGREE_TOKENS), FACTS))
    return {"long": long, "batch": batch, "log": log.read_text()}


@pytest.fixture(scope="module")
def int2_url(model_dir, rotations, bf16_answers, tmp_path_factory):
    """The Hadamard oscar-int2 server, up for the rest of the module (in file order, the others have stopped)."""
    log = tmp_path_factory.mktemp("int2") / "server.log"
    with local_server(model_dir, log, *SERVER_FLAGS, *INT2_FLAGS, "--oscar-rotations", str(rotations[0]),
                      "--enable-cache-report", "--enable-metrics", "--decode-log-interval", str(LOG_INTERVAL)) as url:
        yield url, log


@pytest.fixture(scope="module")
def int2_run(int2_url):
    """Answers of the Hadamard oscar-int2 server to the BF16 prompts and a chat request, and its log."""
    url, log = int2_url
    answers = [_greedy(url, p) for p in PROMPTS]
    chat = post(url, "/v1/chat/completions", {
        "model": "default", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return answers, chat, log.read_text()


# ---------------------------------------------------------------------------
# Refusals (no server comes up; cheap, so first)


def _refusal(model, *extra):
    """Launch a server that must refuse to start; returns its exit code and output."""
    return refused(model, *extra, timeout_s=REFUSE_TIMEOUT_S)


@pytest.mark.slow
def test_wrong_model_artifact_refuses_to_start(model_dir, rotations):
    code, out = _refusal(model_dir, "--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rotations[1]))
    assert code != 0
    assert "calibrated for a different model" in out and "architecture 'Qwen2ForCausalLM'" in out, out[-3000:]
    assert "fired up" not in out


def test_int2_without_rotations_says_how_to_create_them(model_dir):
    code, out = _refusal(model_dir, "--kv-cache-dtype", "oscar-int2")
    assert code != 0
    assert "oscar-calibrate --model MODEL --out DIR" in out, out[-3000:]


def _truncate_tensors(d):
    path = d / "rotations.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "rotations.safetensors: unreadable safetensors file"


def _garble_manifest(d):
    path = d / "manifest.json"
    path.write_text(path.read_text()[:-40])
    return "manifest.json: not valid JSON"


def _skew_rotation(d):
    """Rewrite the tensors with safetensors directly (artifacts.save would refuse): layer 3's K rotation scaled."""
    from safetensors.torch import load_file

    from artifact_files import rewrite_tensors

    path = d / "rotations.safetensors"
    tensors = load_file(str(path))
    tensors["layers.3.k_rotation"] = tensors["layers.3.k_rotation"] * 1.01
    rewrite_tensors(d, tensors)   # a crafted artifact: its digest recorded again
    return "layers.3.k_rotation is not orthogonal (max |R^T R - I| = "


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [_truncate_tensors, _garble_manifest, _skew_rotation],
                         ids=["truncated-tensors", "invalid-json-manifest", "non-orthogonal-rotation"])
def test_corrupted_artifact_refuses_to_start(model_dir, rotations, tmp_path, corrupt):
    d = tmp_path / "rotations"
    shutil.copytree(rotations[0], d)
    sentence = corrupt(d)
    code, out = _refusal(model_dir, "--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(d))
    assert code != 0
    # The artifacts module's ArtifactError sentence, naming the file, as the launcher's one-line error.
    assert "oscar-sglang: error: " in out and str(d) in out and sentence in out, out[-3000:]
    assert "fired up" not in out and "Traceback" not in out


# ---------------------------------------------------------------------------
# Calibrated artifact: agreement with BF16


@pytest.mark.slow
def test_calibrated_artifact_agrees_with_bf16(calibrated_run, bf16_answers):
    """Leading greedy tokens (of AGREE_TOKENS) on which the calibrated INT2 server agrees with BF16, per prompt.

    Each prompt is 23-31 tokens, so from the second generated token on most of the prompt is read from
    INT2 (only 4 sink + 16 recent positions are BF16).  Asserted: every answer has the first token of
    BF16's and at least 6 of the 8 prompts agree on the first FIRST_TOKENS tokens (measured: see -s).
    """
    log = calibrated_run["log"]
    line = [x for x in log.splitlines() if "oscar-int2 KV cache:" in x]
    assert line and "method=oscar-center" in line[0], log[-4000:]
    # made with the default --bits: a precision policy, served layer by layer in its formats
    a = artifacts.load(calibrated_run["dir"])
    assert 2.5 < a.bits_per_element <= 2.75 and len({f.k for f in a.layer_formats}) > 1, a.policy_summary()
    assert f"{a.bits_per_element:.4g} bits/element (layers per format: {a.policy_summary()})" in line[0], line[0]
    assert f"at {a.bytes_per_token()} B/token" in line[0], line[0]
    counts = []
    for prompt, int2, bf16 in zip(FACTS, calibrated_run["cold"], bf16_answers["facts"]):
        assert int2["prompt_tokens"] > SINK + RECENT and int2["cached"] == 0
        counts.append(_leading_agreement(int2["ids"], bf16["ids"]))
        print(f"  agree {counts[-1]}/{AGREE_TOKENS}  bf16 {bf16['text']!r}  int2 {int2['text']!r}")
    hit = calibrated_run["hit"][0]
    hit_count = _leading_agreement(hit["ids"], bf16_answers["facts"][-1]["ids"])
    print(f"calibrated oscar-int2 vs BF16, leading agreeing tokens of {AGREE_TOKENS}: {counts} "
          f"(mean {sum(counts) / len(counts):.1f}); last prompt re-sent as a full cache hit "
          f"({hit['cached']} cached tokens): {hit_count}")
    assert all(c >= 1 for c in counts), counts
    assert sum(c >= FIRST_TOKENS for c in counts) >= 6, counts


# ---------------------------------------------------------------------------
# SGLang's scheduling with a wide window: like BF16


def test_chunked_prefill_and_retraction_answer_like_bf16(scheduled_run, bf16_answers, rotations):
    """Chunks of 64 over pages of 16 and requests retracted and resumed, with mixed per-layer formats, answer
    like the BF16 server up to float noise: with a window wider than every request, each read is a BF16 row,
    so any difference would come from the glue (the extend over a cached prefix, the hot window across
    chunks, the page-16 slot mapping, a retracted request's rows), not from INT2."""
    log = scheduled_run["log"]
    assert re.search(r"retract", log, re.IGNORECASE), "SGLang never retracted a request"
    line = [x for x in log.splitlines() if "oscar-int2 KV cache:" in x]
    a = artifacts.load(rotations[2])
    assert line and f"(layers per format: {a.policy_summary()})" in line[0], log[-4000:]
    ref, got = bf16_answers["long"][0], scheduled_run["long"][0]
    assert got["prompt_tokens"] == ref["prompt_tokens"] > 5 * CHUNK and got["prompt_tokens"] + N_LONG < WIDE
    _same_up_to_noise(ref, got, "chunked prefill (page 16, mixed formats) vs BF16")
    for ref, got in zip(bf16_answers["facts"], scheduled_run["batch"]):
        assert got["completion_tokens"] == AGREE_TOKENS and got["prompt_tokens"] == ref["prompt_tokens"]
        _same_up_to_noise(ref, got, "8 at once, retracted and resumed (page 16) vs BF16 one at a time")


def test_chunked_prefill_through_the_sdpa_path_answers_like_bf16(scheduled_run, bf16_answers):
    """OSCAR_SGLANG_EXTEND_KERNEL=sdpa on the real server: every chunk's extend over its cached prefix runs
    through kernels/extend/sdpa.py (the prefix dequantized, then torch SDPA), over mixed per-layer formats;
    with every read a BF16 row the long answer is BF16's up to float noise (the test above)."""
    log = scheduled_run["log"]
    assert "oscar_int2 attention: extend through the sdpa path" in log, log[-4000:]
    ref, got = bf16_answers["long"][0], scheduled_run["long"][0]
    assert got["prompt_tokens"] == ref["prompt_tokens"] > 5 * CHUNK


# ---------------------------------------------------------------------------
# The Hadamard INT2 server


def test_int2_server_starts_with_the_plugin(int2_run):
    _, _, log = int2_run
    line = [x for x in log.splitlines() if "oscar-int2 KV cache:" in x]
    assert line, log[-4000:]
    assert "method=hadamard" in line[0] and "2.5 bits/element" in line[0]
    assert "sink=4, recent=16" in line[0] and "KV capacity=2048 tokens" in line[0]
    assert "Scheduler hit an exception" not in log


def test_int2_greedy_first_tokens_match_bf16(int2_run, bf16_answers):
    answers, _, _ = int2_run
    for int2, bf16 in zip(answers, bf16_answers["completions"]):
        assert int2["prompt_tokens"] > 20, "the prompt must outgrow sink + recent"
        assert int2["tokens"][:FIRST_TOKENS] == bf16["tokens"][:FIRST_TOKENS], (int2["text"], bf16["text"])
    assert "Tokyo" in answers[0]["text"]


def test_int2_chat_completions_answer(int2_run):
    _, chat, _ = int2_run
    assert chat["choices"][0]["message"]["content"].strip()


def test_openai_client_talks_to_the_int2_server(int2_url):
    """The README's client path: the `openai` package against the INT2 server, chat and completions.

    Only the protocol is checked here (the answer's quality is the BF16-agreement tests' job: with
    Hadamard rotations at sink 4 / recent 16 and the chat template's prefix cached from earlier
    requests, the wording depends on what ran before).
    """
    from openai import OpenAI

    url, _ = int2_url
    client = OpenAI(base_url=url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="default", temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    assert chat.choices[0].message.content.strip() and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > SINK + RECENT and 1 <= chat.usage.completion_tokens <= 12
    flush_cache(url)  # both completions below start from an empty cache, so they must be identical
    done = client.completions.create(model="default", prompt=PROMPTS[0], temperature=0, max_tokens=4)
    assert done.usage.prompt_tokens > SINK + RECENT and done.usage.completion_tokens == 4
    flush_cache(url)
    assert done.choices[0].text == _greedy(url, PROMPTS[0], max_tokens=4)["text"]   # same as over plain HTTP


def test_a_server_stopped_on_purpose_is_not_taken_for_a_crash(bf16_answers):
    """The launcher's stop ends the scheduler first; SGLang reads that as a crash and, with its crash
    diagnostics on (its default), slept 5 s before looking for a scheduler to dump (launcher.STOPPED_ON_PURPOSE)."""
    log = bf16_answers["stopped_log"]
    assert "SIGTERM received" in log and "crash diagnostics" not in log, log[-2000:]


def test_launcher_reports_a_server_that_cannot_start(tmp_path):
    """A model folder without a model: the launcher raises with the server's own error, not a hang."""
    from oscar_sglang.sglang.launcher import ServerError

    (tmp_path / "model").mkdir()
    with pytest.raises(ServerError, match="server exited with"):
        with local_server(tmp_path / "model", tmp_path / "server.log", *SERVER_FLAGS, timeout_s=300):
            pass


def test_prefix_cache_hit_continues_like_the_uncached_request(int2_url, model_dir):
    """A request whose prompt extends an earlier request's prompt + answer is served from the cache
    and continues exactly like the uncached request that never stopped.

    Why this comparison: oscar_int2 prefills a request's new tokens with exact attention among
    themselves and reads the cached prefix as stored (INT2, BF16 at sink and recent positions).  So a
    cache hit cannot equal a cold prefill of the same prompt in principle (see the next test), but it
    must equal the cold request's own decoding, which reads the very same stored rows with the very
    same sink/recent pattern.  Cold request A: the ~115-token prompt P, K + M tokens g.  After a flush,
    P with K tokens reproduces g[:K] bit for bit; then B = P + g[:K] (token ids) hits the cache on all
    but its last token (its K/V was never computed) and must answer g[K:] up to float noise (an
    extend of one token is not bit-identical to a decode step on CPU).
    """
    from transformers import AutoTokenizer

    url, _ = int2_url
    k, m = 8, 8
    prompt = AutoTokenizer.from_pretrained(model_dir)(LONG_PREFIX + CONCURRENT[8])["input_ids"]
    assert len(prompt) > 5 * (SINK + RECENT)

    flush_cache(url)
    full = _generate(url, prompt, k + m)
    assert full["cached"] == 0 and full["prompt_tokens"] == len(prompt)
    flush_cache(url)
    first = _generate(url, prompt, k)
    assert first["cached"] == 0
    assert (first["ids"], first["logprobs"]) == (full["ids"][:k], full["logprobs"][:k])

    second = _generate(url, prompt + first["ids"], m)
    assert second["prompt_tokens"] == len(prompt) + k
    assert second["cached"] == len(prompt) + k - 1, "the whole earlier request must come from the cache"
    tail = {key: full[key][k:] for key in ("ids", "logprobs", "margins")} | {"text": repr(full["ids"][k:])}
    agree, moved = _same_up_to_noise(tail, {**second, "text": repr(second["ids"])}, "cache hit vs uncached decode")
    print(f"\nprefix hit ({second['cached']} of {second['prompt_tokens']} tokens cached): {agree}/{m} tokens "
          f"as the uncached decode, log probabilities within {moved:.3f} nats")


def test_same_prompt_twice_hits_the_cache_reproducibly(int2_url):
    """The same prompt sent again is a full-prefix hit whose answer is reproducible, and a flush restores
    the cold answer bit for bit; the OpenAI endpoint reports the hit in ``usage``.

    Not asserted: hit == cold.  The cold request prefills its prompt with exact attention; the hit reads
    all but the last prompt token back from storage, INT2 at every position except the 4 sink tokens
    (the cached prompt's last 16 positions left the earlier request's recent window while it decoded, so
    their BF16 copies are gone).  With Hadamard rotations that can change the answer from the first
    token on (measured on PROMPTS[0], depending on the pool version: ' Tokyo. The capital of the United
    States ...' cold vs ' the largest city is ...' from the cache), so the hit is compared with itself
    and the cold run with the cold run.
    """
    url, _ = int2_url
    flush_cache(url)
    cold = _generate(url, PROMPTS[0])
    hit = _generate(url, PROMPTS[0])
    again = _generate(url, PROMPTS[0])
    flush_cache(url)
    cold_again = _generate(url, PROMPTS[0])
    assert cold["cached"] == 0 and cold_again["cached"] == 0
    assert hit["cached"] == again["cached"] == hit["prompt_tokens"] - 1 > SINK + RECENT
    assert (again["ids"], again["logprobs"]) == (hit["ids"], hit["logprobs"])
    assert (cold_again["ids"], cold_again["logprobs"]) == (cold["ids"], cold["logprobs"])
    print(f"\nsame prompt: cold {cold['text']!r}, from the cache {hit['text']!r}")

    flush_cache(url)
    first = _greedy(url, PROMPTS[1])
    repeat = _greedy(url, PROMPTS[1])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == repeat["prompt_tokens"] - 1


def test_sixteen_concurrent_requests_equal_their_sequential_answers(int2_url):
    """16 requests in parallel threads all succeed with NEW_TOKENS tokens and repeat their sequential answers.

    Like with like: every sequential request runs after a cache flush, and the concurrent ones after a
    flush with distinct first tokens, so all 32 are cold (cached_tokens == 0) and differ only in
    batching.  Equality up to float noise (module docstring): CPU GEMMs are not batch invariant, so an
    exact equality would not hold even for BF16 (measured: 1 of 6 prompts differs there).
    """
    url, _ = int2_url
    sequential = []
    for prompt in CONCURRENT:
        flush_cache(url)
        sequential.append(_generate(url, prompt))
    flush_cache(url)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        futures = [pool.submit(_generate, url, p) for p in CONCURRENT]
        answers = [f.result() for f in futures]
    wall = time.monotonic() - t0
    agree, moved = [], 0.0
    for prompt, seq, conc in zip(CONCURRENT, sequential, answers):
        assert conc["prompt_tokens"] == seq["prompt_tokens"] > SINK + RECENT
        assert conc["cached"] == 0 and conc["completion_tokens"] == len(conc["ids"]) == NEW_TOKENS
        assert conc["text"].strip()
        n, dlp = _same_up_to_noise(seq, conc, f"concurrent vs sequential on {prompt[:30]!r}")
        agree.append(n)
        moved = max(moved, dlp)
    print(f"\n16 concurrent requests in {wall:.0f} s; leading tokens equal to the sequential answer: {agree}; "
          f"log probabilities within {moved:.3f} nats")


def _metrics(url) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang:oscar_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_hot_pool_is_back_to_one_window_after_the_traffic(int2_url):
    """After every earlier request (16 concurrent among them) and a flush, one request holds exactly its window.

    The requests that ended put their windows out of window (the ``free_rows``
    hook) and the flush freed every entry (the ``clear`` hook): a leak of hot
    entries would show as more than one window in window.  Read from the hot
    pool's log line and the Prometheus series at the decode log interval.
    """
    from oscar_sglang.sglang.metrics import log_lines

    url, log = int2_url
    flush_cache(url)
    before = len(log_lines(log))
    answer = _generate(url, CONCURRENT[0], n=3 * LOG_INTERVAL)
    assert answer["completion_tokens"] == 3 * LOG_INTERVAL
    lines = log_lines(log)[before:]
    assert lines, "no hot pool line at the decode log interval"
    last = lines[-1]
    assert last["in_window"] == SINK + RECENT                  # this request's window, nothing left over
    assert last["in_window_evictions"] == 0 and last["denied"] == 0   # the pool held every window all along
    assert last["reads"] >= answer["prompt_tokens"] and SINK + RECENT <= last["bf16_reads"] <= last["reads"]
    series = _metrics(url)
    assert series["sglang:oscar_hot_in_window_entries"] == SINK + RECENT
    assert series["sglang:oscar_hot_entries"] == last["entries"]
    assert series["sglang:oscar_hot_in_window_evictions_total"] == 0
    assert 0 < series["sglang:oscar_bf16_read_share"] <= 1
    print(f"\nhot pool after the traffic: {last}")
