"""Shared fixtures: real data (scikit-learn digits) and a small BN CNN trained on it."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from torch.utils.data import DataLoader

logging.getLogger("spikingjelly").setLevel(logging.ERROR)
torch.set_num_threads(1)  # two xdist workers on two cores

#: Tests that train on real data for many minutes (the tutorials on Fashion-MNIST). The default
#: run deselects them; ``pytest -m realdata`` (or any ``-m`` expression naming the marker) selects.
REALDATA = "realdata"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{REALDATA}: runs on real data for many minutes; deselected unless selected "
        f"with -m (pytest -m {REALDATA} tests/test_tutorials.py)")


def pytest_collection_modifyitems(config, items):
    """Deselect the ``realdata`` tests unless the ``-m`` expression names the marker."""
    if REALDATA in (config.getoption("markexpr") or ""):
        return
    deselected = [item for item in items if item.get_closest_marker(REALDATA) is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker(REALDATA) is None]


@pytest.fixture(scope="session", autouse=True)
def _no_default_reconstruction():
    """convert()'s layer-wise reconstruction (RECONSTRUCT_STEPS SGD steps where neither QCFS
    training nor fine-tuning runs, T <= 8) is off unless a test asks for it (``reconstruction_steps=``, or the
    ``default_reconstruction`` fixture): hundreds of steps per training-free conversion would
    dominate the suite. tests/test_reconstruct.py covers it. Yields the shipped step count."""
    from snnconv import defaults

    shipped = defaults.RECONSTRUCT_STEPS
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defaults, "RECONSTRUCT_STEPS", 0)
        yield shipped


@pytest.fixture
def default_reconstruction(_no_default_reconstruction, monkeypatch):
    """convert()'s reconstruction default as shipped, within one test; its step count."""
    from snnconv import defaults

    monkeypatch.setattr(defaults, "RECONSTRUCT_STEPS", _no_default_reconstruction)
    return _no_default_reconstruction


@pytest.fixture(scope="session")
def digits_data():
    from snnconv.data import digits

    return digits(seed=0)


@pytest.fixture
def digits_loaders(digits_data):
    """(train, test) DataLoaders over scikit-learn digits, batch 64 / 256."""
    train_set, test_set = digits_data
    train = DataLoader(train_set, batch_size=64, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return train, DataLoader(test_set, batch_size=256)


def _train_on_digits(digits_data, epochs: int, **cnn_options):
    """A SmallCNN (with BatchNorm) trained from seed 0 on the digits training split."""
    from snnconv.demo import train_ann
    from snnconv.models import small_cnn

    torch.manual_seed(0)
    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return train_ann(small_cnn(num_classes=10, in_channels=1, **cnn_options), loader, epochs=epochs,
                     progress=False)


@pytest.fixture(scope="session")
def _trained_digits_cnn(digits_data):
    return _train_on_digits(digits_data, epochs=15)


@pytest.fixture
def trained_digits_cnn(_trained_digits_cnn):
    """A SmallCNN with BatchNorm trained on digits (about 98% test accuracy); a fresh copy."""
    return copy.deepcopy(_trained_digits_cnn)


@pytest.fixture
def no_tf32():
    """Float32 on the GPU as on CPU (TF32 would round matrix inputs to 10 bits)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


FASHION_ROOT = os.environ.get("SNNCONV_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not os.path.exists(os.path.join(FASHION_ROOT, "t10k-labels-idx1-ubyte.gz")),
    reason="Debian's dataset-fashion-mnist is not installed (make data)")


# --- fine-tuning tests (test_finetune.py, test_resume.py, test_distributed.py) ----------------

@pytest.fixture(scope="session")
def _small_digits_ann(digits_data):
    """A width-8 SmallCNN (with BatchNorm) trained on digits for 8 epochs (built once)."""
    return _train_on_digits(digits_data, epochs=8, width=8)


@pytest.fixture
def small_digits_ann(_small_digits_ann):
    """A trained width-8 SmallCNN with BatchNorm; a fresh copy."""
    return copy.deepcopy(_small_digits_ann)


@pytest.fixture(scope="session")
def _small_digits_snn(_small_digits_ann, digits_data):
    import snnconv

    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    snn, _ = snnconv.convert(copy.deepcopy(_small_digits_ann), loader, T=4, L=4, qcfs_epochs=1,
                             per_channel=False, finetune_epochs=0, progress=False)
    return snn


@pytest.fixture
def small_digits_snn(_small_digits_snn):
    """The width-8 digits SmallCNN converted at T=4, L=4 (per-layer thresholds); a fresh copy."""
    return copy.deepcopy(_small_digits_snn)
