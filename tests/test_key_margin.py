"""The pass-key margin (``calibration.evaluate.key_margin``): the smallest log-probability lead of the key's tokens
under greedy decoding, negative where another token won; checked against log-softmax by hand."""

import math

import torch

from oscar_sglang.calibration.evaluate import key_margin


def _logits(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_a_greedy_key_has_the_smallest_lead_in_log_probability():
    steps = [_logits([0.7, 0.2, 0.1]), _logits([0.1, 0.5, 0.4]), _logits([0.05, 0.05, 0.9])]
    got = key_margin(steps, generated=[0, 1, 2], target=[0, 1, 2])
    leads = [math.log(0.7 / 0.2), math.log(0.5 / 0.4), math.log(0.9 / 0.05)]
    assert math.isclose(got, min(leads), rel_tol=1e-6)
    assert got > 0


def test_a_lost_key_is_negative_by_how_much_the_winner_beat_it_and_stops_there():
    steps = [_logits([0.8, 0.1, 0.1]), _logits([0.2, 0.3, 0.5]), _logits([0.98, 0.01, 0.01])]
    # step 1: the key wants token 1 (0.3), greedy took token 2 (0.5); step 2 is after the divergence: not counted
    got = key_margin(steps, generated=[0, 2, 0], target=[0, 1, 1])
    assert math.isclose(got, math.log(0.3 / 0.5), rel_tol=1e-6)


def test_invariant_to_a_constant_shift_of_the_logits_and_nan_without_steps():
    steps = [_logits([0.6, 0.3, 0.1])]
    assert math.isclose(key_margin([s + 17.0 for s in steps], [0], [0]), key_margin(steps, [0], [0]), rel_tol=1e-5)
    assert math.isnan(key_margin([], [], [0]))
