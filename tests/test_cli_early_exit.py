"""``snnconv calibrate-exit`` and ``snnconv evaluate --early-exit``: the rule stored in the network
file, and evaluation.json's early-exit record beside the fixed-T accuracy."""

from __future__ import annotations

import json

import pytest

from snnconv.cli import main
from snnconv.exit_rule import ExitRule, stored_rule
from snnconv.snn.network import SpikingNetwork


@pytest.fixture
def run(small_digits_snn, tmp_path):
    small_digits_snn.save(tmp_path / "snn.pt")
    return tmp_path


def _evaluate(run, *flags) -> dict:
    assert main(["evaluate", str(run), "--data", "digits", "--T", "2", "4", "--limit", "60", "--quiet",
                 *flags]) == 0
    return json.loads((run / "evaluation.json").read_text())


def test_calibrate_exit_stores_the_rule_and_evaluate_then_uses_it(run, capsys):
    assert main(["calibrate-exit", str(run), "--data", "digits", "--tolerance", "1", "--rule", "softmax"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'snn.pt'}" in out and "held-out" in out
    snn = SpikingNetwork.load(run / "snn.pt")
    rule = stored_rule(snn.meta)
    assert rule is not None and rule.kind == "softmax" and snn.meta["early_exit"]["tolerance"] == 1.0
    stored = snn.meta["early_exit"]
    assert stored["accuracy"] >= stored["accuracy_fixed"] - 1.0 and stored["data"] == "digits"
    ev = _evaluate(run)  # without a flag: the stored rule
    e = ev["early_exit"]
    assert ExitRule.from_dict(e["rule"]) == rule and e["calibration"]["stored"] is True
    assert e["T"] == 4 and e["images"] == 60 and sum(e["histogram"]) == 60 and len(e["histogram"]) == 4
    assert 1 <= e["mean_steps"] <= 4 and e["accuracy_fixed_T"] == ev["accuracy"]["4"]
    assert e["mean_steps"] == pytest.approx(sum((k + 1) * n for k, n in enumerate(e["histogram"])) / 60)


def test_evaluate_early_exit_without_a_stored_rule_calibrates_one_and_says_so(run, capsys):
    before = (run / "snn.pt").read_bytes()
    assert "early_exit" not in _evaluate(run)  # no rule, no flag: the record of before
    ev = _evaluate(run, "--early-exit")
    assert ev["early_exit"]["calibration"]["stored"] is False
    assert ev["early_exit"]["calibration"]["tolerance"] == 0.3  # the default
    capsys.readouterr()
    assert (run / "snn.pt").read_bytes() == before  # evaluate never rewrites the network
    assert main(["evaluate", str(run), "--data", "digits", "--T", "4", "--limit", "30", "--early-exit"]) == 0
    out = capsys.readouterr().out
    assert "no early-exit rule is stored" in out and "snnconv calibrate-exit stores it" in out
    assert "SNN early exit" in out


def test_exit_tolerance_calibrates_here_whatever_is_stored(run):
    assert main(["calibrate-exit", str(run), "--data", "digits", "--tolerance", "0", "--quiet"]) == 0
    ev = _evaluate(run, "--exit-tolerance", "100")
    cal = ev["early_exit"]["calibration"]
    assert cal["stored"] is False and cal["tolerance"] == 100.0
    assert ev["early_exit"]["mean_steps"] == 1.0  # 100 points buys every image's first step
    assert _evaluate(run)["early_exit"]["calibration"]["tolerance"] == 0.0  # the stored one is kept


@pytest.mark.parametrize("argv, match", [
    (["evaluate", "{run}", "--exit-tolerance", "-1"], "--exit-tolerance"),
    (["calibrate-exit", "{run}", "--tolerance", "101"], "--tolerance"),
    (["calibrate-exit", "{run}", "--rule", "entropy"], "--rule"),
    (["calibrate-exit", "{run}", "--min-steps", "0"], "--min-steps"),
])
def test_early_exit_flags_out_of_range_exit_2(run, argv, match, capsys):
    assert main([a.format(run=run) for a in argv]) == 2
    assert match in capsys.readouterr().err


def test_a_malformed_stored_rule_is_one_line_exit_2(small_digits_snn, tmp_path, capsys):
    small_digits_snn.meta["early_exit"] = {"rule": {"kind": "margin", "threshold": -1}}
    small_digits_snn.save(tmp_path / "snn.pt")
    assert main(["evaluate", str(tmp_path), "--data", "digits", "--T", "4", "--limit", "20", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "malformed" in err and "calibrate" in err


def test_run_with_the_rule_stored_in_the_nir_file(run, capsys):
    """calibrate-exit, export, then run --early-exit: cpu drops exited images, loihi2-sim counts
    each image's work up to its exit; both say so and record it."""
    assert main(["calibrate-exit", str(run), "--data", "digits", "--tolerance", "2", "--quiet"]) == 0
    assert main(["export", str(run)]) == 0
    capsys.readouterr()
    for backend, how, counted in (("cpu", "exited images left the batch", "dropped"),
                                  ("loihi2-sim", "each image's steps up to its exit", "to exit")):
        assert main(["run", str(run), "--backend", backend, "--data", "digits", "--limit", "40", "--quiet",
                     "--early-exit"]) == 0
        out = capsys.readouterr().out
        assert "early exit (margin" in out and how in out and "held at its answer after its exit" in out
        assert "WARNING" not in out  # the quantisation check compares all steps, not the cut counts
        rec = json.loads(next((run / "backends").glob(f"{backend}_*.json")).read_text())
        assert sum(rec["early_exit"]["histogram"]) == 40 and rec["early_exit"]["dropped"] == (backend == "cpu")
        assert rec["early_exit"]["counted"] == counted


def test_run_early_exit_without_a_stored_rule_is_exit_2(run, capsys):
    assert main(["export", str(run)]) == 0
    capsys.readouterr()
    assert main(["run", str(run), "--data", "digits", "--limit", "10", "--early-exit"]) == 2
    assert "stores no early-exit rule" in capsys.readouterr().err


def test_the_report_shows_the_early_exit_curve_histogram_and_mean_steps(run):
    """evaluate with a rule records the rule's curve and the fixed-T run cut at each step (its
    end is the fixed-T accuracy, and the rule's point lies on the curve); the report's headline
    gives the mean steps and an early-exit section plots and tabulates them."""
    assert main(["calibrate-exit", str(run), "--data", "digits", "--tolerance", "1", "--quiet"]) == 0
    e = _evaluate(run)["early_exit"]
    assert len(e["accuracy_by_step"]) == 4 and e["accuracy_by_step"][-1] == pytest.approx(e["accuracy_fixed_T"])
    curve = e["curve"]
    assert curve["kind"] == e["rule"]["kind"] and curve["mean_steps"][-1] == 4
    assert curve["accuracy"][-1] == pytest.approx(e["accuracy_fixed_T"])
    assert any(a == pytest.approx(e["accuracy"]) and s == pytest.approx(e["mean_steps"])
               for a, s in zip(curve["accuracy"], curve["mean_steps"]))
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    headline = page.split("id='headline'")[1].split("</div>")[0]
    assert f"at a mean of {e['mean_steps']:.2f} of 4 steps" in headline
    section = page.split("<h2>Early exit</h2>")[1].split("<h2>")[0]
    assert 'alt="early exit: accuracy against mean steps, exit steps"' in section
    assert f"<td>{e['mean_steps']:.2f}</td>" in section and f"<td>{e['histogram']}</td>" in section


def test_an_early_exit_run_is_recorded_beside_the_fixed_T_run_and_kept_off_the_T_plot(run, capsys):
    assert main(["calibrate-exit", str(run), "--data", "digits", "--tolerance", "2", "--quiet"]) == 0
    assert main(["export", str(run), "--quiet"]) == 0
    base = ["run", str(run), "--backend", "cpu", "--data", "digits", "--limit", "40", "--quiet"]
    assert main(base) == 0 and main(base + ["--early-exit"]) == 0
    records = [json.loads(p.read_text()) for p in (run / "backends").glob("cpu_*.json")]
    assert sorted(bool(r.get("early_exit")) for r in records) == [False, True]  # neither replaced the other
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    accuracy = page.split("<h2>Accuracy against time steps</h2>")[1].split("<h2>")[0]
    assert "early exit" not in accuracy
    assert "backend cpu (digits, early exit)" in page.split("<h2>Early exit</h2>")[1].split("<h2>")[0]
