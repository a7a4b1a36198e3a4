"""The plan before training-style work: convert() times a step of each such stage, records and
logs the stages, steps and estimated seconds, cuts a default budget that passes its time budget
(and says so), and never changes a budget the caller set."""

from __future__ import annotations

import pytest
import torch

import snnconv
from snnconv import defaults
from snnconv import plan as plan_module

#: The default reconstruction's steps in these tests (the shipped 300 take minutes).
RECONSTRUCT_STEPS = 20


@pytest.fixture(autouse=True)
def _short_default_reconstruction(monkeypatch):
    monkeypatch.setattr(defaults, "RECONSTRUCT_STEPS", RECONSTRUCT_STEPS)


def _convert(model, loader, **kw):
    return snnconv.convert(model, loader, T=4, on_collapse="warn", **kw)


def test_the_plan_names_each_training_stage_its_steps_and_time_and_is_printed(
        small_digits_ann, digits_loaders, capsys):
    train, _ = digits_loaders
    snn, meta = _convert(small_digits_ann, train, finetune_epochs=0, progress=True)
    plan = meta.plan
    stages = {s["name"]: s for s in plan["stages"]}
    assert set(stages) == {"calibration", "reconstruction"}
    rec = stages["reconstruction"]
    assert rec["steps"] == RECONSTRUCT_STEPS and rec["cut_from"] is None and rec["T"] == 4
    assert rec["seconds_per_step"] > 0 and rec["seconds"] == pytest.approx(rec["seconds_per_step"] * rec["steps"])
    assert plan["seconds"] == pytest.approx(sum(s["seconds"] for s in plan["stages"]))
    assert any("reconstruction_steps" in c for c in plan["cheaper"])
    err = capsys.readouterr().err
    assert "snnconv plan on cpu" in err and f"reconstruction: {RECONSTRUCT_STEPS} step(s)" in err
    assert err.index("snnconv plan") < err.rindex(f"reconstruction: {RECONSTRUCT_STEPS}/{RECONSTRUCT_STEPS}")
    assert snnconv.ConversionMeta.from_json(meta.to_json()).plan == meta.plan


def test_a_conversion_without_training_has_no_plan(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    _, meta = _convert(small_digits_ann, train, finetune_epochs=0, reconstruction_steps=0, progress=False)
    assert meta.plan == {}


def test_a_default_budget_past_its_time_budget_is_cut_and_the_plan_says_so(
        small_digits_ann, digits_loaders, monkeypatch, caplog):
    train, _ = digits_loaders
    monkeypatch.setattr(plan_module, "TIME_BUDGETS", {"qcfs": 1e-9, "reconstruction": 1e-9, "finetune": 1e-9})
    with caplog.at_level("INFO", logger="snnconv.plan"):
        _, meta = _convert(small_digits_ann, train, finetune_epochs=0, progress=False)
    assert f"cut from the default {RECONSTRUCT_STEPS} steps" in caplog.text
    rec = {s["name"]: s for s in meta.plan["stages"]}["reconstruction"]
    assert rec["cut_from"] == RECONSTRUCT_STEPS and rec["steps"] == plan_module.MIN_STEPS
    assert meta.settings["reconstruction_steps"] == plan_module.MIN_STEPS
    assert meta.stage("spiking").changes["reconstruction"]["steps"] == plan_module.MIN_STEPS

    _, tuned = _convert(small_digits_ann, train, progress=False)  # the default fine-tuning, cut
    ft = {s["name"]: s for s in tuned.plan["stages"]}["finetune"]
    assert ft["cut_from"] > ft["steps"] == plan_module.MIN_STEPS
    assert tuned.stage("finetune").changes["steps"] == plan_module.MIN_STEPS
    assert tuned.settings["budget"]["finetune_steps"] == plan_module.MIN_STEPS


def test_a_budget_the_caller_set_is_never_cut(small_digits_ann, digits_loaders, monkeypatch):
    train, _ = digits_loaders
    monkeypatch.setattr(plan_module, "TIME_BUDGETS", {"qcfs": 1e-9, "reconstruction": 1e-9, "finetune": 1e-9})
    _, meta = _convert(small_digits_ann, train, finetune_epochs=0, reconstruction_steps=40, progress=False)
    rec = {s["name"]: s for s in meta.plan["stages"]}["reconstruction"]
    assert rec["steps"] == 40 and rec["cut_from"] is None
    assert meta.stage("spiking").changes["reconstruction"]["steps"] == 40


def test_the_plan_leaves_the_conversion_as_it_was(small_digits_ann, digits_loaders):
    """Timing steps on a provisional network reads no random number and changes nothing: two
    conversions give the same network, and the global RNG moves as the stages move it."""
    train, _ = digits_loaders
    torch.manual_seed(5)
    a, _ = _convert(small_digits_ann, train, finetune_epochs=0, reconstruction_steps=3, progress=False)
    after_a = torch.rand(1)
    torch.manual_seed(5)
    b, _ = _convert(small_digits_ann, train, finetune_epochs=0, reconstruction_steps=3, progress=False)
    assert torch.equal(torch.rand(1), after_a)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_step_time_extrapolates_along_a_fixed_cost_and_a_cost_per_image(monkeypatch):
    """One image and two give the line where the second image costs as much as a step's fixed
    part or more; otherwise (or where the step is cheap) the batch is timed itself, where that
    is cheap."""
    x = torch.zeros(8, 1)

    def clock(*costs):
        it = iter(costs)
        monkeypatch.setattr(plan_module, "_timed", lambda fn: (fn(), next(it))[1])

    clock(10.0, 16.0)  # one image (its own warm-up, being slow), then two: 4 s a step and 6 s an image
    assert plan_module._step_time(lambda v: None, x, 32) == pytest.approx(10.0 + 6.0 * 31)
    clock(1.0, 1.1, 1.2)  # the second image adds 10%: the 8 images of x are timed
    assert plan_module._step_time(lambda v: None, x, 32) == pytest.approx(1.2 * 32 / 8)
    clock(10.0, 11.0)  # the same, but timing 8 images would take long: the line
    assert plan_module._step_time(lambda v: None, x, 32) == pytest.approx(10.0 + 1.0 * 31)
    clock(0.01, 0.01, 0.2)  # cheap (a warm-up, then one image): the batch timed at once
    assert plan_module._step_time(lambda v: None, x, 32) == pytest.approx(0.2 * 32 / 8)


def test_the_plan_line_of_fine_tuning_names_its_bptt_horizon_not_a_network_T():
    """At T=8 fine-tuning unrolls BPTT over 16 steps; the plan must not read as a T=16 network."""
    plan = plan_module.WorkEstimate("cpu", [plan_module.StageEstimate("reconstruction", 300, 32, 8),
                                    plan_module.StageEstimate("finetune", 675, 16, 16)])
    lines = plan.summary().splitlines()
    assert "at T=8" in lines[1]
    assert "image(s), BPTT through 16 time steps" in lines[2] and "T=16" not in lines[2]
