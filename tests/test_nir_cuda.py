"""On a CUDA device: a NIR round trip is bit for bit there too, and the hard-reset neuron is
spikingjelly's IFNode(v_reset=0.) there too. Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

import pytest
import torch
from test_hard_reset import _sj_hard
from test_nir import _assert_same_run, _convert, _through_file

from snnconv.snn.neuron import IFNeuron

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.usefixtures("no_tf32")]  # float32 on the GPU as on CPU


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_round_trip_on_the_gpu_is_bit_identical(reset, tmp_path):
    snn = _convert("resnet8", per_channel=True, reset=reset)
    back = _through_file(snn, tmp_path)
    _assert_same_run(snn.cuda(), back.cuda(), torch.rand(4, 3, 16, 16, device="cuda"))


def test_hard_reset_on_the_gpu_is_spikingjellys_ifnode():
    x = torch.randn(8, 16, 32, 5, device="cuda")
    ours = IFNeuron(0.7, 8, reset="zero").cuda()(x.reshape(128, 32, 5)).reshape(x.shape)
    assert torch.equal(ours, _sj_hard(x, 0.7))
