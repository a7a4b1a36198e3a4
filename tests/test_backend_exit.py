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


def test_loihi2_sim_counts_each_images_work_up_to_its_exit(compiled):
    snn, _, x = compiled
    program = get("loihi2-sim").compile(export_nir(snn, input_shape=SHAPE), reference=False)
    x = x[:10]
    fixed = program.run(x, 6)
    rule = _rules(fixed.outputs)[1]
    run = program.run(x, 6, exit_rule=rule)
    k = run.extra["early_exit"]["steps"]
    assert run.extra["early_exit"]["counted"] == "to exit" and 1 < float(k.double().mean()) < 6
    assert torch.equal(run.outputs, fixed.outputs)  # the simulation itself is the fixed one
    cut = [ExitRule("margin", 0.0, min_steps=int(s)) for s in k]  # exits at exactly step k[i]
    alone = [program.run(x[i:i + 1], 6, exit_rule=cut[i]) for i in range(len(x))]
    for i, a in enumerate(alone):
        assert int(a.extra["early_exit"]["steps"][0]) == int(k[i])
    for name, counts in run.spikes.items():
        assert torch.equal(counts, sum(a.spikes[name] for a in alone)), name
        full = fixed.spikes[name]
        assert torch.equal(counts, sum(torch.where(torch.arange(1, 7) <= k[i], program.run(x[i:i + 1], 6).spikes[name],
                                                   0.0) for i in range(len(x)))) or not full.any()
    for name, ops in run.synops.items():
        assert ops == pytest.approx(sum(a.synops[name] for a in alone)), name
        assert ops <= fixed.synops[name]
    e, e_fixed = run.extra["energy"], fixed.extra["energy"]
    assert e["steps_per_image"] == pytest.approx(float(k.double().mean()))
    assert e["neuron_updates_per_image"] < e_fixed["neuron_updates_per_image"]
    assert e["per_image_J"] < e_fixed["per_image_J"]
    assert run.extra["latency"]["steps"] == pytest.approx(float(k.double().mean()) + program.q.depth)


@pytest.mark.parametrize("entry", [{"rule": {"kind": "margin", "threshold": "__import__('os')"}},
                                   {"rule": [1, 2]}, "margin", {"kind": "margin"}])
def test_the_rule_travels_in_the_nir_metadata_and_a_crafted_one_is_a_nir_error(compiled, entry):
    from snnconv.errors import NIRError
    from snnconv.exit_rule import META_KEY, stored_rule
    from snnconv.snn.nir_io import from_nir

    snn = compiled[0]
    rule = ExitRule("softmax", 0.75, min_steps=2)
    snn.meta[META_KEY] = {"rule": rule.to_dict(), "tolerance": 0.3}
    try:
        graph = export_nir(snn, input_shape=SHAPE)
    finally:
        del snn.meta[META_KEY]
    assert stored_rule(from_nir(graph).meta) == rule
    graph.metadata[META_KEY] = entry
    with pytest.raises(NIRError, match="metadata.*early-exit rule.*malformed"):
        from_nir(graph)
