"""One op vocabulary (snnconv.nir.ops): every table keyed by it covers it, and every module kind
the activation checks accept is either written to NIR or refused by name before export writes."""

from __future__ import annotations

import nir
import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.errors import NIRError
from snnconv.kinds import ACCEPTED_MODULES
from snnconv.nir import reader
from snnconv.nir.ops import LINEAR, NEURONS, OPS, PASS, ROLES, WEIGHTED
from snnconv.snn.nir_io import NO_NIR_FORM, READERS, WRITERS, export_nir, no_nir_form

pytestmark = pytest.mark.portable


def test_every_op_has_a_role_and_every_nir_node_type_is_read_as_one_op():
    assert all(op.role in ROLES for op in OPS.values())
    node_types = [cls for cls, _ in reader._NODE_KINDS]
    assert len(node_types) == len(set(node_types)) == sum(len(op.nodes) for op in OPS.values())
    assert reader.KINDS == tuple(OPS)
    assert set(WEIGHTED) | set(PASS) == set(LINEAR) and not set(LINEAR) & set(NEURONS)


def test_the_executor_and_the_loihi_mapping_cover_the_vocabulary():
    from snnconv_backends.engine.ops import OP_BUILDERS, RUNNABLE
    from snnconv_backends.engine.stats import MACS
    from snnconv_backends.loihi2.ops import LINEAR_KINDS

    # the plan builds the neurons; a builder for every other op
    assert set(OP_BUILDERS) == set(OPS) - set(NEURONS)
    assert set(RUNNABLE) == set(OPS)
    assert set(LINEAR_KINDS) == set(LINEAR)  # the ops the Loihi mapping evaluates (its APPLY table)
    assert set(MACS) == set(WEIGHTED)  # a MAC count (or none, stated) for every weighted op


def test_every_layer_kind_is_one_record_that_every_table_follows():
    """snnconv.kinds: each record's NIR form is ops of the vocabulary and has a writer, or it
    passes its input on, or it names why NIR has none; every kind that reaches a converted
    network is saved; the derived tables are the records'."""
    from snnconv.kinds import ACCEPTED_MODULES as accepted
    from snnconv.kinds import KINDS, ROLES, SAVED, kind_of

    assert accepted is ACCEPTED_MODULES
    assert len({k.name for k in KINDS}) == len(KINDS) and all(k.role in ROLES for k in KINDS)
    for k in KINDS:
        assert set(k.nir) <= set(OPS), k.name
        assert not (k.nir and k.no_nir), k.name
        reaches_nir = k.role in ("between", "spiking") and not k.no_nir
        assert (k.name in WRITERS) == reaches_nir, k.name  # a writer for every kind export meets
        assert (k.saved is None) == (k.name == "batchnorm"), k.name  # all but the folded kind are saved
        for m in k.modules:
            assert kind_of(m) is k
            assert (m in NO_NIR_FORM) == bool(k.no_nir)
            assert (m.__name__ in SAVED) == (k.saved is not None)
    assert set(WRITERS) <= {k.name for k in KINDS}
    assert set(READERS) == set(OPS) - {"input", "output", "sum"}  # every op read back as a module
    written = {op for k in KINDS for op in k.nir}
    assert written == set(OPS) - {"input", "output", "sum", *NEURONS} | {"neuron"}  # leaky neurons: read only


def _net(kind: type) -> tuple[nn.Module, tuple[int, ...]]:
    """A small network holding one module of ``kind`` between spiking layers, and its input shape."""
    d = {"1d": 1, "2d": 2, "3d": 3}.get(kind.__name__[-2:], 2)
    shape = (2,) + (6,) * d
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[d]
    n = 4 * 6 ** d
    if kind in (nn.Linear, nn.Flatten, nn.Identity) or issubclass(kind, nn.Dropout) and d == 2:
        mid: list[nn.Module] = [kind(0.1)] if issubclass(kind, nn.modules.dropout._DropoutNd) else (
            [nn.Identity()] if kind is nn.Identity else [])
        layers = [conv(2, 4, 3, padding=1), nn.ReLU(), *mid, nn.Flatten(), nn.Linear(n, 8), nn.ReLU(),
                  nn.Linear(8, 3)]
    elif kind is nn.Unflatten:
        layers = [nn.Flatten(), nn.Linear(72, 48), nn.ReLU(), nn.Unflatten(1, (2, 4, 6)), nn.Conv2d(2, 4, 3),
                  nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)]
    elif issubclass(kind, nn.modules.batchnorm._BatchNorm):
        layers = [conv(2, 4, 3, padding=1), kind(4), nn.ReLU(), nn.Flatten(), nn.Linear(n, 3)]
    elif issubclass(kind, (nn.modules.conv._ConvNd,)):
        layers = [kind(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(n, 3)]
    elif "Adaptive" in kind.__name__:
        layers = [conv(2, 4, 3, padding=1), nn.ReLU(), kind(1), nn.Flatten(), nn.Linear(4, 3)]
    elif "AvgPool" in kind.__name__:
        layers = [conv(2, 4, 3, padding=1), nn.ReLU(), kind(2), nn.Flatten(), nn.Linear(4 * 3 ** d, 3)]
    elif "ZeroPad" in kind.__name__:
        layers = [conv(2, 4, 3, padding=1), nn.ReLU(), kind(1), conv(4, 4, 3), nn.ReLU(), nn.Flatten(),
                  nn.Linear(n, 3)]
    elif issubclass(kind, nn.modules.dropout._DropoutNd):
        layers = [conv(2, 4, 3, padding=1), nn.ReLU(), kind(0.1), nn.Flatten(), nn.Linear(n, 3)]
    else:  # nn.ReLU
        layers = [conv(2, 4, 3, padding=1), kind(), nn.Flatten(), nn.Linear(n, 3)]
    return nn.Sequential(*layers).eval(), shape


@pytest.mark.parametrize("kind", ACCEPTED_MODULES, ids=lambda k: k.__name__)
def test_each_accepted_module_kind_converts_saves_then_exports_exactly_or_is_refused_by_name(kind, tmp_path):
    if kind is nn.modules.batchnorm._BatchNorm:
        kind = nn.BatchNorm2d
    torch.manual_seed(0)
    model, shape = _net(kind)
    assert any(type(m) is kind or (kind is nn.Identity and isinstance(m, nn.Identity)) for m in model.modules())
    x = torch.rand(16, *shape)
    snn, meta = snnconv.convert(model, [(x, torch.zeros(16, dtype=torch.long))], T=2, L=4, calib_batches=1,
                             bias_calibration=False, finetune_epochs=0, reconstruction_steps=0,
                             progress=False, on_collapse="warn")
    snn.save(tmp_path / "snn.pt")  # every kind that converts is saved: the file gives the same network
    back = snnconv.SpikingNetwork.load(tmp_path / "snn.pt")
    with torch.no_grad():
        assert torch.equal(back.run(x, 2), snn.run(x, 2)), kind.__name__
    refused = {type(m).__name__ for m in model.modules() if type(m) in NO_NIR_FORM}
    assert (kind.__name__ in refused) == (kind in NO_NIR_FORM)
    assert meta.stage("prepare").changes["no_nir_form"] == no_nir_form(model)  # known before the work
    if refused:  # (a pass-through 3-d dropout sits in a network of 3-d convolutions)
        assert len(no_nir_form(model)) == len(no_nir_form(snn)) >= len(refused)
        with pytest.raises(NIRError, match="|".join(refused)):
            export_nir(snn, input_shape=shape)
        return
    assert no_nir_form(snn) == []
    graph = export_nir(snn, input_shape=shape)
    assert isinstance(graph, nir.NIRGraph)
    result = snnconv.backends.get("cpu").compile(graph).run(x, 2)
    with torch.no_grad():
        expected = snn.run(x, 2)
    assert torch.equal(result.outputs, expected), kind.__name__
