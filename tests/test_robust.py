"""Robust conversion (issue 14): reproducibility, collapse detection, the allow-list of ops
between neurons, and the linear-time bias calibration."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import snnconv


def _state(snn):
    return {k: v.clone() for k, v in snn.state_dict().items()}


# --- item 3: the result is a function of model, data, settings and seed ---------------------

def test_eval_loader_leaves_the_converted_network_bit_identical(small_digits_ann, digits_data):
    """A loader shuffled by the global RNG: evaluating between stages must not reshuffle it."""
    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True)  # global-RNG shuffling
    test = DataLoader(test_set, batch_size=256)
    options = dict(T=4, L=4, calib_batches=2, qcfs_epochs=1, progress=False, seed=3)
    plain, _ = snnconv.convert(small_digits_ann, loader, **options)
    evaluated, meta = snnconv.convert(small_digits_ann, loader, eval_loader=test, eval_T=(2,),
                                      **options)
    assert set(meta.accuracy) >= {"ann", "folded", "qcfs", "snn"}
    a, b = _state(plain), _state(evaluated)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
