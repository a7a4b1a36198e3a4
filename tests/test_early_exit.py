"""Early exit: the rule, the step-by-step run that drops exited images, calibration and evaluation.

Where outputs are compared bit for bit, the networks are exactly representable (weights on a
grid of 1/64, thresholds powers of two, inputs on a grid of 1/16): every sum a layer computes is
then exact in float32 whatever order a kernel adds in, so the comparisons test the early-exit
logic and not the kernels' rounding at another batch size.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_spiking import _randomise_bn as _random_bn

import snnconv
from snnconv import models
from snnconv.analysis.early_exit import calibrate_exit, evaluate_exit, exit_curves, observe_exits
from snnconv.analysis.metrics import evaluate, predictions
from snnconv.errors import ConfigError, DataError
from snnconv.exit_rule import EXIT_RULES, ExitRule, accumulate, exit_histogram, exit_score, stored_rule
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import IFNeuron, Scale
from snnconv.snn.stepping import Stepper

# --------------------------------------------------------------------------------------------
# networks


def _batches(n: int, size: int = 32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.round(torch.rand(size, 3, 8, 8, generator=g) * 16) / 16 for _ in range(n)]


def _exact(snn: SpikingNetwork) -> SpikingNetwork:
    """``snn`` with every weight and bias on a grid of 1/64 and every threshold a power of two."""
    with torch.no_grad():
        for m in snn.net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.copy_(torch.round(m.weight * 64) / 64)
                if m.bias is not None:
                    m.bias.copy_(torch.round(m.bias * 64) / 64)
            elif isinstance(m, (IFNeuron, Scale)):
                m.theta.copy_(2.0 ** torch.round(torch.log2(m.theta)))
    return snn


def _spiking(reset: str = "subtract", burst: int = 1, per_channel: bool = True) -> SpikingNetwork:
    torch.manual_seed(0)
    batches = _batches(2)
    model = _random_bn(models.resnet8(num_classes=10, in_channels=3))
    folded = snnconv.fold_batchnorm(model, batches[0])
    qann = snnconv.calibrate_qcfs(folded, batches, per_channel=per_channel, progress=False)
    return _exact(snnconv.to_spiking(qann, T=8, reset=reset, burst=burst))


def _leaky() -> tuple[SpikingNetwork, torch.Tensor]:
    """A NIR network of LIF, CubaLIF and LI neurons (tests/_lif_nets.py), weights on the grid."""
    from _lif_nets import chip_net

    from snnconv.snn.nir_io import from_nir

    g = chip_net(seed=1, classes=5)
    for node in g.nodes.values():
        for key in ("weight", "bias"):
            if hasattr(node, key):
                setattr(node, key, (np.round(getattr(node, key) * 64) / 64).astype(np.float32))
    x = torch.round(torch.rand(48, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 32) / 16
    return from_nir(g, T=8), x


NETS = {"subtract": lambda: _spiking(), "zero": lambda: _spiking(reset="zero"),
        "burst": lambda: _spiking(burst=2), "per_layer": lambda: _spiking(per_channel=False)}


@pytest.fixture(scope="module", params=[*NETS, "leaky"])
def net(request):
    """(an exactly representable network, a batch of 48 inputs on the grid)."""
    if request.param == "leaky":
        return _leaky()
    return NETS[request.param](), torch.cat(_batches(2, 24, seed=1))


def _rules(steps: torch.Tensor) -> list[ExitRule]:
    """Rules of both kinds whose thresholds stop some images early and some late on ``steps``."""
    totals = accumulate(steps)
    out = []
    for kind in EXIT_RULES:
        scores = torch.stack([exit_score(kind, totals[k], k + 1) for k in range(len(steps))])
        for q, min_steps in ((0.3, 1), (0.6, 2), (0.85, 1)):
            out.append(ExitRule(kind, float(scores.quantile(q)), min_steps))
    return out


# --------------------------------------------------------------------------------------------
# the rule


@pytest.mark.parametrize("fields, match", [
    (("entropy", 0.5), "kind must be one of"),
    (("margin", -0.1), "threshold must be a number >= 0"),
    (("margin", math.nan), "threshold must be a number >= 0"),
    (("margin", True), "threshold must be a number"),
    (("margin", "0.5"), "threshold must be a number"),
    (("softmax", 1.5), "at most 1"),
    (("margin", 0.5, 0), "min_steps"),
    (("margin", 0.5, 1.5), "min_steps"),
    (("margin", 0.5, True), "min_steps"),
])
def test_a_rule_out_of_range_is_refused_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        ExitRule(*fields)
    with pytest.raises(ValueError):  # a ConfigError is a ValueError
        ExitRule(*fields)


@pytest.mark.parametrize("rule", [ExitRule("margin", 0.25), ExitRule("softmax", 0.9, 3),
                                  ExitRule("margin", math.inf, 2), ExitRule("softmax", 1.0)])
def test_a_rule_round_trips_through_plain_data(rule):
    import json

    data = json.loads(json.dumps(rule.to_dict()))  # JSON-ready, inf included
    assert ExitRule.from_dict(data) == rule


@pytest.mark.parametrize("data, match", [({"kind": "margin"}, "keys"), ({"kind": "margin", "threshold": 1, "x": 2},
                                         "keys"), ([1, 2], "dict"), ({"kind": "margin", "threshold": "big"},
                                                                     "number")])
def test_a_malformed_stored_rule_is_refused(data, match):
    with pytest.raises(ConfigError, match=match):
        ExitRule.from_dict(data)
    with pytest.raises(ConfigError, match="malformed.*calibrate_exit"):
        stored_rule({"early_exit": {"rule": data}})


def test_scores_by_hand():
    total = torch.tensor([[6.0, 2.0, 4.0], [1.0, 1.0, 0.0]])
    assert exit_score("margin", total, 2).tolist() == [1.0, 0.0]  # (6 - 4) / 2, a tie
    soft = torch.softmax(total.double() / 2, dim=1).amax(1)
    assert torch.equal(exit_score("softmax", total, 2), soft)
    with pytest.raises(DataError, match="two classes"):
        exit_score("margin", torch.ones(4, 1), 1)
    with pytest.raises(DataError, match=r"shape \(4, 3, 2\)"):
        exit_score("softmax", torch.ones(4, 3, 2), 1)


@pytest.mark.parametrize("seed", range(10))
def test_exit_steps_are_the_first_step_the_rule_is_met_never_before_min_steps_nor_after_T(seed):
    g = torch.Generator().manual_seed(seed)
    T, B = int(torch.randint(1, 9, (1,), generator=g)), 64
    steps = torch.randn(T, B, 5, generator=g)
    totals = accumulate(steps)
    for rule in _rules(steps) + [ExitRule("margin", 0.0, 3), ExitRule("softmax", math.inf)]:
        exits = rule.exit_steps(steps)
        assert bool(((exits >= min(rule.min_steps, T)) & (exits <= T)).all())
        for i, k in enumerate(exits.tolist()):
            met = [bool(rule.met(totals[j - 1, i:i + 1], j)) for j in range(1, T)]
            assert not any(met[:k - 1])  # not met before its exit step
            assert k == T or met[k - 1]


def test_accumulate_adds_one_step_at_a_time():
    steps = torch.randn(6, 3, 4)
    total = steps[0]
    for k in range(1, 6):
        total = total + steps[k]
        assert torch.equal(accumulate(steps)[k], total)
    assert exit_histogram(torch.tensor([1, 3, 3, 6]), 6) == [1, 0, 2, 0, 0, 1]


# --------------------------------------------------------------------------------------------
# the run that drops exited images


def test_an_image_that_exits_at_step_k_has_the_fixed_T_output_truncated_at_k(net):
    snn, x = net
    with torch.no_grad():
        steps = snn.run(x, T=8)
    totals = accumulate(steps)
    seen = set()
    for rule in _rules(steps):
        run = snn.run_with_exit(x, rule, T=8)
        assert torch.equal(run.steps, rule.exit_steps(steps))
        k = run.steps
        expected = totals[k - 1, torch.arange(len(x))] / k.reshape(-1, 1).float()
        assert torch.equal(run.output, expected)
        seen |= set(k.tolist())
    assert len(seen) >= 4  # the rules stopped images at several steps


def test_dropping_exited_images_never_changes_the_others_spikes_or_readouts(net):
    snn, x = net
    full, part = Stepper(snn.net, record=True), Stepper(snn.net, record=True)
    g = torch.Generator().manual_seed(0)
    alive = torch.arange(len(x))
    with torch.no_grad():
        full.start(x)
        part.start(x)
        for _ in range(8):
            r_full, r_part = full.step(), part.step()
            assert torch.equal(r_part, r_full[alive])
            s_full, s_part = full.spikes, part.spikes
            assert s_full.keys() == s_part.keys() and len(s_full) >= 2
            assert all(torch.equal(s_part[n], s_full[n][alive]) for n in s_full)
            kept = torch.rand(len(alive), generator=g) > 0.3
            alive = alive[kept]
            part.keep(kept)


def test_the_exit_of_an_image_does_not_depend_on_the_batch_it_runs_in(net):
    snn, x = net
    with torch.no_grad():
        rule = _rules(snn.run(x, T=8))[1]
        whole = snn.run_with_exit(x, rule, T=8)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        shuffled = snn.run_with_exit(x[perm], rule, T=8)
        alone = [snn.run_with_exit(x[i:i + 1], rule, T=8) for i in range(0, len(x), 7)]
    assert torch.equal(shuffled.output, whole.output[perm]) and torch.equal(shuffled.steps, whole.steps[perm])
    for j, i in enumerate(range(0, len(x), 7)):
        assert torch.equal(alone[j].output[0], whole.output[i]) and alone[j].steps.item() == whole.steps[i]


@pytest.mark.parametrize("chunk_size", [1, 5, 0])
def test_chunks_give_the_same_exits(chunk_size):
    snn = _spiking()
    x = torch.cat(_batches(2, 24, seed=1))
    with torch.no_grad():
        rule = _rules(snn.run(x, T=8))[0]
        whole = snn.run_with_exit(x, rule, T=8)
        snn.chunk_size = chunk_size
        chunked = snn.run_with_exit(x, rule, T=8)
    assert torch.equal(chunked.output, whole.output) and torch.equal(chunked.steps, whole.steps)


def test_without_a_rule_every_result_is_todays_bit_for_bit():
    """On a network that is not exactly representable too: rule None is the fixed-T path."""
    torch.manual_seed(0)
    batches = [torch.rand(40, 3, 8, 8) for _ in range(2)]
    qann = snnconv.calibrate_qcfs(snnconv.fold_batchnorm(_random_bn(models.resnet8(num_classes=10, in_channels=3)),
                                                         batches[0]), batches, progress=False)
    snn = snnconv.to_spiking(qann, T=6)
    x = batches[1]
    with torch.no_grad():
        today = snn(x)
        run = snn.run_with_exit(x, None)
    assert torch.equal(run.output, today) and run.steps.tolist() == [6] * len(x)
    data = [(x[:25], today[:25].argmax(1)), (x[25:], torch.arange(15) % 10)]
    ev = evaluate_exit(snn, data, None)
    pred, y = predictions(snn, data)  # today's evaluation (evaluate() is their mean in float32)
    assert ev.accuracy == 100.0 * int((pred == y).sum()) / 40 == pytest.approx(evaluate(snn, data), abs=1e-5)
    assert ev.mean_steps == 6 and ev.histogram == [0] * 5 + [40]
    # a network without a stored rule: "stored" (the default) is no rule
    assert evaluate_exit(snn, data) == ev


def test_a_rule_argument_of_the_wrong_kind_is_refused():
    snn = _spiking()
    with pytest.raises(ConfigError, match="'stored'"):
        snn.run_with_exit(torch.zeros(2, 3, 8, 8), "margin")
    with pytest.raises(ConfigError, match="ExitRule"):
        snn.run_with_exit(torch.zeros(2, 3, 8, 8), {"kind": "margin", "threshold": 1})


# --------------------------------------------------------------------------------------------
# calibration and evaluation


@pytest.fixture(scope="module")
def labelled():
    """A network and labelled batches: half its own fixed-T answers, half random labels."""
    snn = _spiking()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        data = [(x, snn(x).argmax(1) if i % 2 else torch.randint(0, 10, (len(x),), generator=g))
                for i, x in enumerate(_batches(4, seed=2))]
    return snn, data


def test_the_curve_is_what_evaluation_measures_at_each_threshold(labelled):
    snn, data = labelled
    curves = exit_curves(snn, data, min_steps=2)
    for kind, curve in curves.items():
        assert curve.thresholds[0] == 0.0 and curve.thresholds[-1] == math.inf
        assert curve.mean_steps == sorted(curve.mean_steps)  # a stricter threshold never runs fewer steps
        assert curve.mean_steps[0] == 2 and curve.mean_steps[-1] == 8
        assert curve.accuracy[-1] == curve.accuracy_fixed
        picks = sorted({0, 1, len(curve.thresholds) // 3, len(curve.thresholds) // 2, len(curve.thresholds) - 2,
                        len(curve.thresholds) - 1})
        for i in picks:
            ev = evaluate_exit(snn, data, ExitRule(kind, curve.thresholds[i], 2))
            assert (ev.accuracy, ev.mean_steps) == pytest.approx((curve.accuracy[i], curve.mean_steps[i]), abs=1e-9)
            assert curve.point(curve.thresholds[i]) == i
        # a threshold chosen elsewhere lands on the point whose behaviour it has
        g = torch.Generator().manual_seed(3)
        for t in torch.rand(5, generator=g).double() * curve.edges[-1]:
            ev = evaluate_exit(snn, data, ExitRule(kind, float(t), 2))
            i = curve.point(float(t))
            assert (ev.accuracy, ev.mean_steps) == pytest.approx((curve.accuracy[i], curve.mean_steps[i]), abs=1e-9)


@pytest.mark.parametrize("tolerance", [0.0, 1.0, 5.0, 30.0])
@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("kind", EXIT_RULES)
def test_the_calibrated_rule_meets_its_tolerance_on_the_data_it_was_calibrated_on(labelled, tolerance, labels,
                                                                                  kind):
    snn, data = labelled
    snn = copy.deepcopy(snn)
    inputs = data if labels else [x for x, _ in data]
    rec = calibrate_exit(snn, inputs, tolerance=tolerance, labels=labels, rule=kind)
    assert rec.rule.kind == kind and rec.targets == ("labels" if labels else "fixed-T answers")
    assert rec.accuracy >= rec.accuracy_fixed - tolerance - 1e-9
    assert sum(rec.histogram) == rec.images == 128
    # what the record says is what the network does with the rule it stored
    if labels:
        ev = evaluate_exit(snn, data)  # the stored rule, by default
        assert ev.rule == rec.rule
        assert (ev.accuracy, ev.mean_steps, ev.histogram) == (rec.accuracy, rec.mean_steps, rec.histogram)
    else:
        assert rec.accuracy_fixed == 100.0
    # the loosest: every looser setting misses the tolerance somewhere at or below it
    curve = rec.curve
    i = curve.thresholds.index(rec.rule.threshold)
    assert all(a >= rec.accuracy_fixed - tolerance - 1e-9 for a in curve.accuracy[i:])
    assert i == 0 or curve.accuracy[i - 1] < rec.accuracy_fixed - tolerance


def test_calibration_chooses_the_min_steps_with_the_fewest_mean_steps(labelled):
    snn, data = labelled
    obs = observe_exits(snn, data)
    for tolerance in (0.0, 2.0, 10.0):
        chosen = obs.calibrate("margin", tolerance)
        by_min_steps = [obs.calibrate("margin", tolerance, m).mean_steps for m in range(1, 9)]
        assert chosen.mean_steps == min(by_min_steps)
        assert chosen.rule.min_steps == 1 + by_min_steps.index(min(by_min_steps))  # the first of equals
        assert chosen == calibrate_exit(snn, data, tolerance=tolerance, store=False)  # one run, any setting


def test_a_larger_tolerance_never_costs_more_steps(labelled):
    snn, data = labelled
    steps = [calibrate_exit(snn, data, tolerance=t, store=False).mean_steps for t in (0.0, 0.5, 2.0, 10.0, 100.0)]
    assert steps == sorted(steps, reverse=True) and steps[-1] == 1.0


def test_the_stored_rule_round_trips_through_save_and_load(labelled, tmp_path):
    snn, data = labelled
    snn = copy.deepcopy(snn)
    rec = calibrate_exit(snn, data, tolerance=2.0, min_steps=2, rule="softmax")
    assert stored_rule(snn.meta) == rec.rule
    snn.save(tmp_path / "snn.pt")
    loaded = SpikingNetwork.load(tmp_path / "snn.pt")
    assert stored_rule(loaded.meta) == rec.rule and loaded.meta["early_exit"] == rec.to_dict()
    x = data[0][0]
    default, explicit = loaded.run_with_exit(x), loaded.run_with_exit(x, rec.rule)
    assert torch.equal(default.steps, explicit.steps) and torch.equal(default.output, explicit.output)
    # no rule where none was asked: the fixed-T output
    assert torch.equal(loaded.run_with_exit(x, None).output, loaded(x))


def test_calibration_without_labels_needs_labels_false(labelled):
    snn, data = labelled
    with pytest.raises(DataError, match="labels=False"):
        calibrate_exit(snn, [x for x, _ in data], store=False)
    with pytest.raises(DataError, match="empty"):
        calibrate_exit(snn, [], store=False)


@pytest.mark.parametrize("kw, match", [({"tolerance": -1}, "tolerance"), ({"tolerance": "1"}, "tolerance"),
                                       ({"rule": "entropy"}, "kind of exit rule"), ({"min_steps": 0}, "min_steps"),
                                       ({"T": 0}, "T")])
def test_calibration_settings_out_of_range_are_refused(labelled, kw, match):
    snn, data = labelled
    with pytest.raises(ConfigError, match=match):
        calibrate_exit(snn, data, store=False, **kw)


def test_anytime_horizons_are_the_powers_of_two_up_to_2T_and_T():
    from snnconv.defaults import anytime_horizons

    assert anytime_horizons(8) == (1, 2, 4, 8, 16)
    assert anytime_horizons(6) == (1, 2, 4, 6, 8, 12)
    assert anytime_horizons(1) == (1, 2)


def test_convert_for_early_exit_trains_every_readout_judges_them_and_stores_a_rule(digits_data, small_digits_ann):
    """``early_exit=True``: the fine-tuning recipe trains the readouts from the first step, the
    judge compares the networks at every one of them, and the rule calibrated on the judge's
    held-out images is stored (it travels to evaluate_exit and to NIR)."""
    from torch.utils.data import DataLoader

    from snnconv.defaults import anytime_horizons
    from snnconv.snn.nir_io import export_nir, from_nir

    train, _ = digits_data
    loader = DataLoader(train, 64, shuffle=True, generator=torch.Generator().manual_seed(0))
    snn, meta = snnconv.convert(small_digits_ann, loader, T=4, early_exit=True, finetune_epochs=1,
                                reconstruction_steps=0, progress=False)
    assert meta.settings["early_exit"] is True
    tuned = meta.stage("finetune").changes["kept"]
    assert tuned["horizons"] == list(anytime_horizons(4))
    assert "at" not in tuned  # asked for early exit: judged on the readouts alone
    record = meta.stage("early_exit").changes
    rule = stored_rule(snn.meta)
    assert rule is not None and ExitRule.from_dict(record["rule"]) == rule and record["T"] == 4
    assert record["accuracy"] >= record["accuracy_fixed"] - 0.3 - 1e-9 and record["images"] == tuned["images"]
    assert stored_rule(from_nir(export_nir(snn)).meta) == rule
    plain, plain_meta = snnconv.convert(small_digits_ann, loader, T=4, finetune_epochs=0, reconstruction_steps=0,
                                        progress=False)
    assert stored_rule(plain.meta) is None and "early_exit" not in [s.name for s in plain_meta.stages]


def test_the_default_fine_tuning_at_T_8_is_judged_on_every_readout_and_at_T(digits_data, small_digits_ann):
    """From ANYTIME_FROM_T the default recipe trains every readout; the judge keeps the result
    only where it wins over all of them beyond the noise and is not worse at T beyond the noise
    there; no rule is stored."""
    from torch.utils.data import DataLoader

    from snnconv.defaults import ANYTIME_FROM_T, anytime_horizons

    train, _ = digits_data
    loader = DataLoader(train, 64, shuffle=True, generator=torch.Generator().manual_seed(0))
    snn, meta = snnconv.convert(small_digits_ann, loader, T=ANYTIME_FROM_T, finetune_epochs=1,
                                reconstruction_steps=0, progress=False)
    judged = meta.stage("finetune").changes["kept"]
    assert judged["horizons"] == list(anytime_horizons(ANYTIME_FROM_T))
    at = judged["at"]
    assert at["steps"] == ANYTIME_FROM_T
    beyond = judged["wins"] - judged["losses"] >= max(1.0, (judged["wins"] + judged["losses"]) ** 0.5)
    assert judged["kept"] == (beyond and at["wins"] - at["losses"] >= -(at["wins"] + at["losses"]) ** 0.5)
    assert stored_rule(snn.meta) is None and "early_exit" not in [s.name for s in meta.stages]
