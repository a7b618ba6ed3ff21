"""The accuracy table of ``oscar-eval`` (``calibration.report``): well-formed with and without perplexities."""

import pytest

from oscar_sglang.calibration import report


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _results(ctxs):
    ppl = {str(c): {"ppl": 10.0 + c / 1000, "ppl_tail": 11.0} for c in ctxs}
    niah = [{"length": 4096, "depth": 0.5, "hits": [True, False, True]}]
    return {"bf16": {"ppl": ppl, "layer_errors": None, "niah": niah},
            "optr@3": {"ppl": ppl, "layer_errors": [0.1, 0.3], "niah": [{"hits": [True, True, False]}],
                       "bits_per_element": 3.0}}


@pytest.mark.parametrize("ctxs", [[], [1024], [1024, 2048]], ids=["no-ppl", "one", "two"])
def test_every_row_has_the_header_s_columns(ctxs):
    lines = report.accuracy_table(_results(ctxs)).splitlines()
    n = len(_cells(lines[0]))
    assert n == 7 + 2 * len(ctxs)
    assert all(len(_cells(line)) == n for line in lines[1:])
    assert "" not in _cells(lines[0])
    row = dict(zip(_cells(lines[0]), _cells(lines[3])))
    assert row["method"] == "optr@3" and row["bits/elt"] == "3" and row["mean layer err"] == "0.200"
    assert row["pass keys found"] == "2/3" and row["BF16's passes kept"] == "1/2"
    for c in ctxs:
        assert row[f"PPL {c}"] == f"{10 + c / 1000:.2f}" and row[f"PPL {c} tail"] == "11.00"


def test_margin_columns_are_the_mean_and_the_paired_change_against_bf16():
    niah = lambda hits, margins: [{"length": 4096, "depth": 0.5, "hits": hits, "margins": margins}]
    results = {"bf16": {"ppl": {}, "layer_errors": None, "niah": niah([True, True, False, True], [2.0, 1.0, -0.5, 3.0])},
               "int2": {"ppl": {}, "layer_errors": [0.2], "niah": niah([True, False, False, True], [1.0, -0.2, -1.5, None])},
               "old": {"ppl": {}, "layer_errors": [0.2], "niah": [{"hits": [True, True, False, True]}]}}
    lines = report.accuracy_table(results).splitlines()
    head = _cells(lines[0])
    rows = {r[0]: dict(zip(head, r)) for r in map(_cells, lines[2:])}
    assert rows["bf16"]["key margin"] == "1.38" and rows["bf16"]["margin vs BF16"] == "–"
    # int2: trials 1-3 paired (the 4th has no margin): changes -1.0, -1.2, -1.0
    diffs = [-1.0, -1.2, -1.0]
    mean = sum(diffs) / 3
    half = 1.96 * (sum((d - mean) ** 2 for d in diffs) / 2 / 3) ** 0.5
    assert rows["int2"]["key margin"] == f"{(1.0 - 0.2 - 1.5) / 3:.2f}"
    assert rows["int2"]["margin vs BF16"] == f"{mean:+.2f} ± {half:.2f}"
    assert rows["old"]["key margin"] == "–" and rows["old"]["margin vs BF16"] == "–"   # JSON from before margins
    assert report.paired_margin_change([1.0], [2.0, 3.0]) is None                      # different trials: no pairing


def test_the_margin_plot_pairs_trials_with_bf16_and_is_skipped_without_margins(tmp_path):
    niah = lambda margins: [{"length": 4096, "depth": 0.5, "hits": [m > 0 for m in margins], "margins": margins}]
    results = {"bf16": {"niah": niah([2.0, 1.0, -0.5])}, "int2": {"niah": niah([1.0, -0.2, -1.5])}}
    assert report.plot_margins(results, tmp_path / "m.png", "t")
    assert (tmp_path / "m.png").stat().st_size > 1000
    old = {"bf16": {"niah": [{"hits": [True]}]}, "int2": {"niah": [{"hits": [False]}]}}
    assert not report.plot_margins(old, tmp_path / "none.png", "t") and not (tmp_path / "none.png").exists()
