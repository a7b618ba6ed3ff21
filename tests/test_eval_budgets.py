"""oscar-eval's ``--policy-bits`` loop (``eval_cli._policy_budgets``): budgets share one cost measurement per
symmetric-rows flag, the base artifact is looked up only when a budget asks for it, the config is restored."""

import argparse

from oscar_sglang.calibration import eval_cli
from oscar_sglang.calibration.calibrate import CalibrationConfig


def _fake_policy(monkeypatch):
    measured = []

    def policy_costs(lm, pstats, base, cfg, progress, fixed):
        measured.append((base, cfg.symmetric_rows))
        return f"costs(sym={cfg.symmetric_rows})"

    def apply_policy(lm, pstats, base, cfg, progress, fixed, costs):
        assert costs == f"costs(sym={cfg.symmetric_rows})"
        return (base, cfg.bits, cfg.symmetric_rows)

    monkeypatch.setattr(eval_cli, "policy_costs", policy_costs)
    monkeypatch.setattr(eval_cli, "apply_policy", apply_policy)
    return measured


def test_no_budget_needs_no_base(monkeypatch):
    measured = _fake_policy(monkeypatch)
    args = argparse.Namespace(policy_bits=[], policy_base="optr")
    assert list(eval_cli._policy_budgets(args, None, None, {}, CalibrationConfig(), False, None)) == []
    assert measured == []


def test_budgets_share_costs_per_symmetric_flag(monkeypatch):
    measured = _fake_policy(monkeypatch)
    args = argparse.Namespace(policy_bits=eval_cli._budgets("2.5sym,2.75,3sym,3"), policy_base="optr")
    cfg = CalibrationConfig()
    out = list(eval_cli._policy_budgets(args, None, None, {"optr": "BASE"}, cfg, False, None))
    assert [n for n, _, _ in out] == ["optr@2.5sym", "optr@2.75", "optr@3sym", "optr@3"]
    assert [a for _, a, _ in out] == [("BASE", 2.5, True), ("BASE", 2.75, False), ("BASE", 3.0, True),
                                      ("BASE", 3.0, False)]
    assert measured == [("BASE", True), ("BASE", False)]
    assert (cfg.bits, cfg.symmetric_rows) == (None, False)
