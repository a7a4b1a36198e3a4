"""Early exit on the cpu backend: each image runs until its readout meets the rule, then leaves the
batch. Properties, on exactly representable networks (weights on a grid, thresholds powers of two,
so that a kernel's rounding cannot depend on the batch it runs in): the exits and answers are
those of the fixed-T run truncated at each image's step, and the torch network's; the spike
counts are those of the steps each image ran; without a rule nothing changes."""

from __future__ import annotations

import pytest
import torch
from test_early_exit import _leaky, _rules, _spiking

from snnconv.errors import BackendError
from snnconv.exit_rule import ExitRule, accumulate
from snnconv.snn.nir_io import export_nir
from snnconv_backends import get

pytestmark = pytest.mark.portable

SHAPE = (3, 8, 8)


@pytest.fixture(scope="module", params=["subtract", "zero", "burst"])
def compiled(request):
    snn = _spiking(**({"burst": 2} if request.param == "burst" else {"reset": request.param}))
    x = torch.round(torch.rand(40, *SHAPE, generator=torch.Generator().manual_seed(3)) * 16) / 16
    return snn, get("cpu").compile(export_nir(snn, input_shape=SHAPE)), x


def test_exits_and_answers_are_the_fixed_run_truncated_at_each_images_step(compiled):
    snn, program, x = compiled
    fixed = program.run(x, 8)
    totals = accumulate(fixed.outputs)
    seen = set()
    for rule in _rules(fixed.outputs):
        record = program.run(x, 8, exit_rule=rule).extra["early_exit"]
        k = record["steps"]
        assert torch.equal(k, rule.exit_steps(fixed.outputs))
        assert torch.equal(record["output"], totals[k - 1, torch.arange(len(x))] / k.reshape(-1, 1).float())
        torch_run = snn.run_with_exit(x, rule, T=8)  # the torch network decides the same
        assert torch.equal(torch_run.steps, k) and torch.equal(torch_run.output, record["output"])
        assert record["mean_steps"] == pytest.approx(float(k.double().mean()))
        assert sum(record["histogram"]) == len(x)
        seen |= set(k.tolist())
    assert len(seen) >= 4


def test_spikes_count_only_the_steps_each_image_ran(compiled):
    _, program, x = compiled
    x = x[:12]
    rule = _rules(program.run(x, 8).outputs)[1]
    run = program.run(x, 8, exit_rule=rule)
    k = run.extra["early_exit"]["steps"]
    assert 1 < float(k.double().mean()) < 8
    alone = [program.run(x[i:i + 1], 8) for i in range(len(x))]  # each image's own spikes per step
    for name, counts in run.spikes.items():
        expected = sum(torch.where(torch.arange(1, 9) <= k[i], a.spikes[name], 0.0) for i, a in enumerate(alone))
        assert torch.equal(counts, expected), name
    synops = sum(run.synops.values())
    assert 0 < synops < sum(program.run(x, 8).synops.values())


def test_without_a_rule_nothing_changes(compiled):
    _, program, x = compiled
    a, b = program.run(x, 5), program.run(x, 5, exit_rule=None)
    assert torch.equal(a.outputs, b.outputs) and "early_exit" not in b.extra
    assert all(torch.equal(a.spikes[n], b.spikes[n]) for n in a.spikes)


def test_a_rule_that_never_exits_runs_all_T_and_gives_the_fixed_answer(compiled):
    _, program, x = compiled
    fixed = program.run(x, 6)
    run = program.run(x, 6, exit_rule=ExitRule("margin", float("inf")))
    assert run.extra["early_exit"]["steps"].eq(6).all()
    assert torch.equal(run.outputs, fixed.outputs)
    assert all(torch.equal(run.spikes[n], fixed.spikes[n]) for n in fixed.spikes)


def test_leaky_networks_and_bad_rules_are_refused():
    from _lif_nets import chip_net

    _, x = _leaky()
    program = get("cpu").compile(chip_net(seed=1, classes=5))
    with pytest.raises(BackendError, match="early exit"):
        program.run(x, 4, exit_rule=ExitRule("margin", 0.1))
    with pytest.raises(BackendError, match="exit_rule must be"):
        program.run(x, 4, exit_rule={"kind": "margin", "threshold": 0.1})
    with pytest.raises(BackendError, match="static batch"):
        program.run(x.unsqueeze(0).expand(4, *x.shape).contiguous(), 4, exit_rule=ExitRule("margin", 0.1))


def test_loihi2_sim_applies_the_rule_to_its_readout(compiled):
    snn, _, x = compiled
    program = get("loihi2-sim").compile(export_nir(snn, input_shape=SHAPE))
    x = x[:10]
    fixed = program.run(x, 6)
    rule = _rules(fixed.outputs)[1]
    record = program.run(x, 6, exit_rule=rule).extra["early_exit"]
    k = record["steps"]
    assert torch.equal(k, rule.exit_steps(fixed.outputs)) and record["dropped"] is False
    assert torch.equal(record["output"], accumulate(fixed.outputs)[k - 1, torch.arange(len(x))]
                       / k.reshape(-1, 1).float())
