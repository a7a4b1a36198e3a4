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


#: Every boolean and enum setting of ConvertConfig with the values it takes (None: the default).
_CHOICES = {
    "per_channel": (None, True, False),
    "reset": ("subtract", "zero"),
    "bias_calibration": (True, False),
    "bias_calibration_T": (None, 3, (2, 4)),
    "calibration_reference": ("qcfs", "ann"),
    "threshold_calibration": (None, True, False),
    "weight_calibration": (None, True, False),
    "membrane_calibration": (None, True, False),
    "maxpool": ("auto", "avg", "error"),
    "burst": (1, 2),
    "early_exit": (False, True),
}
_NAMES = tuple(_CHOICES)


def _combinations():
    import itertools

    return [dict(zip(_NAMES, values)) for values in itertools.product(*_CHOICES.values())]


def _config_or_refusal(settings):
    """The resolved config, or the ConfigError's message (which must name a setting given)."""
    try:
        return ConvertConfig(T=2, **settings).resolved()
    except ConfigError as exc:
        named = [k for k in settings if k in str(exc)]
        assert named, (settings, str(exc))
        return str(exc)


def test_every_combination_of_the_settings_resolves_completely_or_is_refused_by_name():
    for settings in _combinations():
        cfg = _config_or_refusal(settings)
        if isinstance(cfg, ConvertConfig):
            assert cfg.is_resolved and cfg.resolved() is cfg, settings
            assert cfg.replace() == cfg, settings  # valid as resolved: the plan's changes validate it again
            for name, value in settings.items():
                if value is not None:  # a setting given is kept as given
                    assert getattr(cfg, name) == value, (settings, name)


def test_the_membrane_calibration_is_a_setting_of_its_own():
    off = ConvertConfig(T=4, membrane_calibration=False).resolved()
    assert (off.membrane_calibration, off.bias_calibration_T, off.weight_calibration, off.per_channel) == \
        (False, 4, False, True)
    with pytest.raises(ConfigError, match="membrane_calibration=True with reset='zero'"):
        ConvertConfig(membrane_calibration=True, reset="zero")
    with pytest.raises(ConfigError, match="bias_calibration=False"):
        ConvertConfig(membrane_calibration=True, bias_calibration=False)


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).eval()


def _tiny_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]


@pytest.mark.parametrize("settings", [
    {"membrane_calibration": False},
    {"membrane_calibration": False, "bias_calibration": False},
])
def test_convert_runs_without_the_membrane_calibration(settings):
    snn, meta = snnconv.convert(_tiny(), _tiny_data(), T=2, finetune_epochs=0, reconstruction_steps=0,
                                calib_batches=1, progress=False, on_collapse="warn", **settings)
    assert meta.settings["membrane_calibration"] is False and meta.settings["per_channel"] is True


def test_convert_runs_or_refuses_by_name_a_sample_of_the_combinations():
    import random
    import warnings

    combos = _combinations()
    sample = random.Random(0).sample(combos, 6)
    model, data = _tiny(), _tiny_data()
    for settings in sample:
        if isinstance(_config_or_refusal(settings), str):
            with pytest.raises(ConfigError):
                snnconv.convert(model, data, T=2, **settings)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                snnconv.convert(model, data, T=2, finetune_epochs=0, reconstruction_steps=0, calib_batches=1,
                                progress=False, on_collapse="warn", **settings)
            except snnconv.UnsupportedLayerError:  # maxpool="error" refuses the max-pooling, by name
                assert settings["maxpool"] == "error", settings
