"""Accuracy of a model through the simulated INT2 cache: layer errors, perplexity, pass-key retrieval.

Every metric takes ``artifact=None`` for the BF16 model itself (plain sdpa).
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext

import torch

from oscar_sglang.artifacts import RotationArtifacts

from .capture import run_layers
from .simulate import SimState, simulated


def _sim(model, artifact, **kw):
    return nullcontext() if artifact is None else simulated(model, SimState(artifact, **kw))


@torch.no_grad()
def layer_errors(model, sequences, artifact: RotationArtifacts, sink=None, recent=None) -> list[float]:
    """Per-layer relative attention-output error after ``W_O``, decode reads, no compounding."""
    state = SimState(artifact, mode="decode", sink=sink, recent=recent, measure=True)
    with simulated(model, state):
        for ids in sequences:
            run_layers(model, ids)
    return state.layer_errors()


@torch.no_grad()
def perplexity(model, sequences, artifact: RotationArtifacts | None, sink=None, recent=None,
               tail_from: int | None = None) -> dict:
    """Teacher-forced perplexity of decoding through the INT2 cache.

    Returns ``{"ppl": all predicted tokens, "ppl_tail": tokens at positions >= tail_from}``
    (``tail_from`` defaults to sink + recent, where INT2 reads begin).
    """
    if tail_from is None:
        tail_from = (artifact.sink if sink is None else sink) + (artifact.recent if recent is None else recent) \
            if artifact is not None else 0
    nll_all, n_all, nll_tail, n_tail = 0.0, 0, 0.0, 0
    with _sim(model, artifact, mode="decode", sink=sink, recent=recent):
        for ids in sequences:
            ids = ids.reshape(1, -1).to(model.device)
            logits = model(ids, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
            nll_all += nll.sum().item()
            n_all += nll.numel()
            tail = nll[max(tail_from - 1, 0):]
            nll_tail += tail.sum().item()
            n_tail += tail.numel()
    return {"ppl": math.exp(nll_all / n_all), "ppl_tail": math.exp(nll_tail / max(n_tail, 1)), "tokens": n_all}


NEEDLE = "The secret pass key is {key}. Remember it: {key} is the pass key."
QUESTION = "What is the secret pass key mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The secret pass key is"  # appended after the generation prompt: the digits come next


def niah_prompt(tokenizer, haystack_ids: list[int], length: int, depth: float, key: str) -> torch.Tensor:
    """A chat prompt of about ``length`` tokens: haystack text with the needle at ``depth`` (0..1), then the question."""
    needle = tokenizer(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False).input_ids
    frame = tokenizer.apply_chat_template([{"role": "user", "content": "X\n\n" + QUESTION}], tokenize=True,
                                          add_generation_prompt=True)
    frame = frame["input_ids"] if hasattr(frame, "keys") else frame
    budget = length - len(needle) - len(frame) - 8
    if budget < 16:
        raise ValueError(f"length {length} is too short for the needle and the question")
    hay = haystack_ids[:budget]
    cut = int(round(depth * len(hay)))
    text = tokenizer.decode(hay[:cut] + needle + hay[cut:])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text + "\n\n" + QUESTION}], tokenize=True,
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    prefix = tokenizer(ANSWER_PREFIX, add_special_tokens=False, return_tensors="pt").input_ids
    return torch.cat([ids.reshape(1, -1), prefix], dim=1)


def key_target(tokenizer, key: str) -> list[int]:
    """Token ids of the key as the answer continues ``ANSWER_PREFIX`` (`` 60494``), tokenized in context."""
    prefix = tokenizer(ANSWER_PREFIX, add_special_tokens=False).input_ids
    full = tokenizer(ANSWER_PREFIX + " " + key, add_special_tokens=False).input_ids
    if full[:len(prefix)] == prefix and len(full) > len(prefix):
        return full[len(prefix):]
    return tokenizer(" " + key, add_special_tokens=False).input_ids


def key_margin(step_logits: list[torch.Tensor], generated: list[int], target: list[int]) -> float:
    """How firmly greedy decoding produced the key: a log-probability margin in nats.

    Walks the key's tokens while greedy decoding follows them; at step ``i``
    the margin is ``logit[target_i] - max(other logits)`` (= the difference of
    log-probabilities).  Returns the smallest margin over the steps walked:
    positive when every key token was the greedy choice (the smallest lead it
    had), negative at the first step where another token won (by how much the
    key token lost).  A continuous, paired measure of retrieval beside the
    pass/fail of a trial: an INT2 cache that keeps a pass but halves its
    margin shows here.  ``nan`` if nothing was generated.
    """
    margins = []
    for i, want in enumerate(target[:min(len(step_logits), len(generated))]):
        row = step_logits[i].reshape(-1).float()
        others = row.clone()
        others[want] = float("-inf")
        margins.append(float(row[want] - others.max()))
        if generated[i] != want:
            break
    return min(margins, default=float("nan"))


@torch.no_grad()
def niah(model, tokenizer, haystack: str, artifact: RotationArtifacts | None, lengths, depths,
         trials: int = 1, sink=None, recent=None, seed: int = 0, max_new_tokens: int = 8) -> list[dict]:
    """Pass-key retrieval with greedy decoding through the cache as served (prefill exact, decode from INT2).

    Per (length, depth): ``hits`` (the key is in the answer), ``answers`` and
    ``margins`` (:func:`key_margin` of each trial, from the logits of the same
    greedy decoding: no extra passes).
    """
    hay_ids = tokenizer(haystack, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    keys = [[[str(rng.randint(10000, 99999)) for _ in range(trials)] for _ in depths] for _ in lengths]
    rows = []
    with _sim(model, artifact, mode="serve", sink=sink, recent=recent):
        for li, length in enumerate(lengths):
            for di, depth in enumerate(depths):
                hits, answers, margins = [], [], []
                for trial in range(trials):
                    key = keys[li][di][trial]
                    # Each trial reads a different stretch of the haystack.
                    offset = (trial * 997) % max(1, len(hay_ids) - length)
                    ids = niah_prompt(tokenizer, hay_ids[offset:], length, depth, key).to(model.device)
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                         do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                         output_logits=True, return_dict_in_generate=True)
                    new_ids = out.sequences[0, ids.shape[1]:].tolist()
                    answer = tokenizer.decode(new_ids, skip_special_tokens=True)
                    hits.append(key in answer)
                    answers.append(answer.strip())
                    m = key_margin([s[0] for s in out.logits], new_ids, key_target(tokenizer, key))
                    margins.append(None if math.isnan(m) else round(m, 4))
                rows.append({"length": length, "depth": depth, "accuracy": sum(hits) / trials, "hits": hits,
                             "keys": keys[li][di], "answers": answers, "margins": margins})
    return rows
