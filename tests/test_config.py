"""ConvertConfig: every setting validated once (ConfigError, also a ValueError), the dependent
defaults resolved in one place, and convert() taking a config or keywords alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.config import MAX_T, ConvertConfig
from snnconv.errors import ConfigError, SnnconvError


@pytest.mark.parametrize("settings", [
    {"T": 0}, {"T": 1.5}, {"T": "4"}, {"T": True}, {"T": MAX_T + 1}, {"T": 10**6}, {"L": 0},
    {"percentile": 0}, {"percentile": 101}, {"percentile": "99"}, {"calib_batches": 0},
    {"calib_batches": 2.5}, {"maxpool": "max"}, {"reset": "hard"}, {"on_collapse": "ignore"},
    {"eval_T": (4, 0)}, {"eval_T": "48"}, {"bias_calibration_T": (4, 8, 16)},
    {"bias_calibration_T": (4, 8), "reset": "zero"}, {"finetune_epochs": -1}, {"qcfs_epochs": 1.0},
    {"weight_calibration": True, "bias_calibration": False}, {"per_channel": "yes"},
    {"device": "no-such-device"}, {"seed": -1},
])
def test_a_bad_setting_is_a_config_error_that_names_it(settings):
    with pytest.raises(ConfigError) as info:
        ConvertConfig(**settings)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SnnconvError)
    assert any(name.split("_")[0] in str(info.value) for name in settings)


def test_resolved_defaults_follow_reset_and_T():
    sub = ConvertConfig(T=4).resolved()
    assert (sub.L, sub.per_channel, sub.threshold_calibration, sub.weight_calibration,
            sub.bias_calibration_T, sub.membrane_calibration) == (4, True, False, True, 8, True)
    hard = ConvertConfig(T=4, reset="zero").resolved()
    assert (hard.L, hard.per_channel, hard.threshold_calibration, hard.weight_calibration,
            hard.bias_calibration_T, hard.membrane_calibration) == (4, False, True, False, 4, False)
    given = ConvertConfig(T=4, L=16, bias_calibration_T=(4, 8), per_channel=False).resolved()
    assert (given.L, given.per_channel, given.horizons, given.membrane_calibration) == (16, False, (4, 8), False)
    assert sub.resolved() is sub


def _data():
    g = torch.Generator().manual_seed(0)
    xs = torch.rand(64, 3, 8, 8, generator=g)
    return [(xs[i:i + 16], torch.randint(0, 4, (16,), generator=g)) for i in range(0, 64, 16)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def test_convert_takes_a_config_or_keywords_with_the_same_result():
    model, data = _model(), _data()
    a, meta_a = snnconv.convert(model, data, T=2, finetune_epochs=0, progress=False, on_collapse="warn")
    cfg = ConvertConfig(T=2, progress=False, on_collapse="warn")
    b, meta_b = snnconv.convert(model, data, cfg, finetune_epochs=0)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    timing = {"total_seconds", "qcfs_seconds", "finetune_seconds"}
    strip = lambda s: {k: ({b: c for b, c in v.items() if b not in timing} if k == "budget" else v)  # noqa: E731
                       for k, v in s.items()}
    assert strip(meta_a.settings) == strip(meta_b.settings)


def test_an_unknown_setting_is_named_with_the_list():
    with pytest.raises(ConfigError, match="'Tsteps'.*the settings are"):
        snnconv.convert(_model(), _data(), Tsteps=4)
    with pytest.raises(ConfigError, match="ConvertConfig"):
        snnconv.convert(_model(), _data(), {"T": 4})
    with pytest.raises(ConfigError, match="resolved"):
        snnconv.convert(_model(), _data(), ConvertConfig(T=4).resolved(), T=8)
