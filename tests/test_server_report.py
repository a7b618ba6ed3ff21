"""The server-level report's scoring (``oscar_sglang.calibration.server_report``) against direct formulas.

The report itself needs two real servers (docs/SERVER_ACCURACY.md); here its
pieces that turn SGLang's logprob lists into numbers: the coarse KL against a
full-distribution KL, agreement at exact ties, the agreed-prefix counts.
"""

import math
import random

import torch

from oscar_sglang.calibration import server_report as sr


def test_coarse_kl_is_the_kl_over_top_k_plus_one_bucket_and_bounds_the_full_kl():
    rng = random.Random(0)
    for _ in range(50):
        vocab, k = 40, rng.choice([1, 3, 8])
        p = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 2, 0)
        q = torch.softmax(torch.log(p) + 0.3 * torch.randn(vocab, dtype=torch.float64), 0)
        top = torch.topk(p, k).indices.tolist()
        ref_row = {"top_ids": top, "top_logprobs": [math.log(p[i]) for i in top]}
        got = sr.kl_coarse(ref_row, {i: math.log(q[i]) for i in range(vocab)})
        rest = [i for i in range(vocab) if i not in top]
        p_rest, q_rest = float(p[rest].sum()), float(q[rest].sum())
        want = sum(float(p[i] * (math.log(p[i]) - math.log(q[i]))) for i in top) + p_rest * math.log(p_rest / q_rest)
        full = float((p * (p.log() - q.log())).sum())
        assert abs(got - max(want, 0.0)) < 1e-9
        assert got <= full + 1e-9                      # merging tokens into a bucket never raises the KL


def test_agreement_counts_ties_and_prefixes():
    assert sr.agree({"logprob": -0.5, "top1_logprob": -0.5})
    assert not sr.agree({"logprob": -0.6, "top1_logprob": -0.5})
    s = sr.summarize_short([[1, 2, 3], [1, 9, 3], [7, 2, 3]], [[1, 2, 3]] * 3, 3)
    assert s["agreed_prefix"] == [3, 1, 0] and s["all_agree"] == 1
    assert s["same_position_tokens"] == 3 + 2 + 2 and s["total_tokens"] == 9


def test_report_names_what_each_artifact_was_calibrated_on(tmp_path):
    # the header comes from each artifact's own manifest, not from the default text split
    from oscar_sglang import artifacts as art

    fp = art.ModelFingerprint("LlamaForCausalLM", 2, 64, 2, 1, 32, 100, "default", 1e4)
    a = art.hadamard(fp)
    a.calibration = {"tokens": 4096, "data": {"spec": "mix", "texts": ["macbeth_gut", "stdlib/ast.py"]}}
    art.save(a, tmp_path / "cal")
    free = art.hadamard(fp)
    free.calibration = {"tokens": 0, "note": "data-free baseline"}
    art.save(free, tmp_path / "free")
    got = sr.method_calibration({"optr": tmp_path / "cal", "optr@3": tmp_path / "cal", "hadamard": tmp_path / "free"})
    assert got == {"optr": "mix (macbeth_gut, stdlib/ast.py)", "optr@3": "mix (macbeth_gut, stdlib/ast.py)",
                   "hadamard": "no calibration text (data-free)"}
    sentence = sr._calibration_sentence({"method_calibration": got})
    assert sentence == ("Rotations calibrated on mix (macbeth_gut, stdlib/ast.py) (optr, optr@3); "
                        "no calibration text (data-free) (hadamard)")
    assert sr._calibration_sentence({"calibration_texts": ["a", "b"]}) == "Rotations calibrated on a, b"
