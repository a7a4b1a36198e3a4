"""Hard reset against subtractive reset on scikit-learn digits (small; about a minute on CPU).

    .venv/bin/python -m benchmarks.studies.hard_reset_digits

Trains the demo's BN SmallCNN on digits (15 epochs, as tests/conftest.py), converts it with
``reset="subtract"`` and ``reset="zero"``, each with and without bias calibration, per layer and
per channel, and prints test accuracy at T = 1, 2, 4, 8, 16, 32.

Its hard-reset rows use threshold calibration, the default for ``reset="zero"`` (calibrated
at T=8). ``benchmarks/matrix/hard_reset.py`` compares the fixes over
three networks, each calibrated at the run T.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.metrics import accuracy_by_T, evaluate
from snnconv.data import digits
from snnconv.demo import train_ann
from snnconv.models import small_cnn

TS = (1, 2, 4, 8, 16, 32)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, test_set = digits(seed=0)
    train = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    test = DataLoader(test_set, batch_size=256)
    ann = train_ann(small_cnn(num_classes=10, in_channels=1), train, epochs=15, progress=False)
    print(f"ANN {evaluate(ann, test):.2f}% on {len(test_set)} test images")
    print(f"{'reset':9}{'thresholds':12}{'bias cal.':10}" + "".join(f"{f'T={t}':>8}" for t in TS))
    for per_channel in (False, True):
        for bias in (False, True):
            for reset in ("subtract", "zero"):
                snn, _ = snnconv.convert(copy.deepcopy(ann), train, T=8, L=8, per_channel=per_channel,
                                         bias_calibration=bias, reset=reset, progress=False)
                acc = accuracy_by_T(snn, test, TS)
                print(f"{reset:9}{'channel' if per_channel else 'layer':12}{'yes' if bias else 'no':10}"
                      + "".join(f"{acc[t]:8.2f}" for t in TS), flush=True)


if __name__ == "__main__":
    main()
