"""End to end on the real SGLang server, on CPU: the INT2 cache answers like BF16 and refuses bad artifacts.

Each test module run starts, one at a time, a BF16 server and an oscar-int2
server (SmolLM2-135M, Hadamard rotations, sink 4, recent 16) on a free port
of 127.0.0.1, and launches that must refuse to start.  Every server is killed
(its whole process group) in the fixture teardown.  Takes a few minutes on
two cores; select with ``-m server`` or skip with ``-m "not server"``.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest

pytestmark = [pytest.mark.server, pytest.mark.model]

START_TIMEOUT_S = 420
REFUSE_TIMEOUT_S = 240
FIRST_TOKENS = 3
# Prompts longer than sink + recent (20 tokens), so decoding reads INT2 rows.
PROMPTS = [
    "Here are some facts about geography. The longest river in Africa is the Nile. The tallest mountain in "
    "the world is Mount Everest. The largest ocean on Earth is the Pacific Ocean. The capital city of Japan is",
    "Question: What is the chemical symbol for gold, and what is its atomic number? Please answer in one "
    "sentence and explain briefly where the symbol comes from.\nAnswer:",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_cmd(model, port, *extra):
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "2048", "--sleep-on-idle",
            *extra]


def _env():
    """The environment a user's server gets: no oscar settings leaking in, no Triton interpreter (conftest)."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("OSCAR_SGLANG_") or k == "OSCAR_SGLANG_CACHE") and k != "TRITON_INTERPRET"}
    return {**env, "SGLANG_USE_CPU_ENGINE": "1"}


def _stop(proc):
    """Terminate the server's whole process group (it was started in a session of its own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@contextmanager
def _server(model, log_path, *extra):
    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_launch_cmd(model, port, *extra), stdout=log, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "The server is fired up" not in log_path.read_text():
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _greedy(url, prompt, max_tokens=8):
    out = _post(url, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0, "logprobs": 1})
    choice = out["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"]}


@pytest.fixture(scope="module")
def model_dir():
    from oscar_sglang import assets

    return assets.default_model_dir()


@pytest.fixture(scope="module")
def rotations(model_dir, tmp_path_factory):
    """A Hadamard artifact for the served model and one calibrated for another model."""
    import dataclasses

    from transformers import AutoConfig

    from oscar_sglang import artifacts

    fp = artifacts.ModelFingerprint.from_config(AutoConfig.from_pretrained(model_dir))
    root = tmp_path_factory.mktemp("rotations")
    wrong = dataclasses.replace(fp, architecture="Qwen2ForCausalLM", num_layers=28)
    return (artifacts.save(artifacts.hadamard(fp), root / "hadamard"),
            artifacts.save(artifacts.hadamard(wrong), root / "wrong"))


@pytest.fixture(scope="module")
def bf16_answers(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bf16") / "server.log"
    with _server(model_dir, log) as url:
        return [_greedy(url, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def int2_run(model_dir, rotations, bf16_answers, tmp_path_factory):
    """Answers of the oscar-int2 server (started after the BF16 one has stopped) and its log."""
    log = tmp_path_factory.mktemp("int2") / "server.log"
    args = ("--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rotations[0]),
            "--oscar-sink", "4", "--oscar-recent", "16")
    with _server(model_dir, log, *args) as url:
        answers = [_greedy(url, p) for p in PROMPTS]
        chat = _post(url, "/v1/chat/completions", {
            "model": "default", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return answers, chat, log.read_text()


def test_int2_server_starts_with_the_plugin(int2_run):
    _, _, log = int2_run
    line = [x for x in log.splitlines() if "oscar-int2 KV cache:" in x]
    assert line, log[-4000:]
    assert "method=hadamard" in line[0] and "2.5 bits/element" in line[0]
    assert "sink=4, recent=16" in line[0] and "KV capacity=2048 tokens" in line[0]
    assert "Scheduler hit an exception" not in log


def test_int2_greedy_first_tokens_match_bf16(int2_run, bf16_answers):
    answers, _, _ = int2_run
    for int2, bf16 in zip(answers, bf16_answers):
        assert int2["prompt_tokens"] > 20, "the prompt must outgrow sink + recent"
        assert int2["tokens"][:FIRST_TOKENS] == bf16["tokens"][:FIRST_TOKENS], (int2["text"], bf16["text"])
    assert "Tokyo" in answers[0]["text"]


def test_int2_chat_completions_answer(int2_run):
    _, chat, _ = int2_run
    assert chat["choices"][0]["message"]["content"].strip()


def _refusal(model, *extra):
    """Launch a server that must refuse to start; returns its exit code and output."""
    proc = subprocess.Popen(_launch_cmd(model, _free_port(), *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=REFUSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail("the server started instead of refusing")
    finally:
        _stop(proc)
    return proc.returncode, out


def test_wrong_model_artifact_refuses_to_start(model_dir, rotations):
    code, out = _refusal(model_dir, "--kv-cache-dtype", "oscar-int2", "--oscar-rotations", str(rotations[1]))
    assert code != 0
    assert "calibrated for a different model" in out and "architecture 'Qwen2ForCausalLM'" in out, out[-3000:]
    assert "fired up" not in out


def test_int2_without_rotations_says_how_to_create_them(model_dir):
    code, out = _refusal(model_dir, "--kv-cache-dtype", "oscar-int2")
    assert code != 0
    assert "oscar-calibrate --model MODEL --out DIR" in out, out[-3000:]
