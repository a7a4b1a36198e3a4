"""Files written by other libraries' NIR exporters, with their own simulation's outputs
(tests/fixtures/nir, made by benchmarks/interop/nir_consumers.py --fixtures): snnconv either runs a
file and gives the same outputs element by element, ties included, or refuses it with a
NIRError that names the node; it never runs one with another meaning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from snnconv.errors import NIRError
from snnconv.snn.nir_io import from_nir, load_nir

FIXTURES = Path(__file__).parent / "fixtures" / "nir"
FILES = sorted(FIXTURES.glob("*.nir"))


def _read(path: Path):
    info = json.loads(path.with_suffix(".json").read_text())
    read = info["read"]
    try:
        graph = load_nir(path, dt=read["dt"])
    except NIRError as exc:
        return info, None, exc
    data = np.load(path.with_suffix(".npz"))
    return info, (from_nir(graph, T=int(data["T"]), dt=read["dt"], compare=read["compare"]), data), None


def test_there_are_fixtures_of_several_libraries():
    libraries = {json.loads(p.with_suffix(".json").read_text())["library"] for p in FILES}
    assert {"spikingjelly", "norse", "sinabs"} <= libraries


#: files whose producer's own simulation is not the NIR meaning it writes
DEPARTS = {"snntorch_lif_mlp": "snntorch's Leaky resets by subtraction, one step late; its "
                               "exporter writes NIR's LIF, which resets to v_reset"}


def _spec_lif_mlp(graph, x: np.ndarray, T: int, dt: float) -> np.ndarray:
    """NIR's meaning of input -> Affine -> LIF -> Affine -> LIF -> output, by hand (forward
    Euler at dt: v += dt/tau * (v_leak - v + r * I); fire on v > v_threshold; v = v_reset)."""
    names = [n for n in ("0", "1", "2", "3")]
    nodes = [graph.nodes[n] for n in names]
    v = [np.zeros((x.shape[0],) + nodes[i].tau.shape, np.float64) for i in (1, 3)]
    outs = []
    for _ in range(T):
        h = x.astype(np.float64)
        for layer, (aff, lif) in enumerate(((nodes[0], nodes[1]), (nodes[2], nodes[3]))):
            i = h @ aff.weight.T.astype(np.float64) + aff.bias
            v[layer] = v[layer] + dt / lif.tau * (lif.v_leak - v[layer] + lif.r * i)
            s = v[layer] > lif.v_threshold
            v[layer] = np.where(s, lif.v_reset, v[layer])
            h = s.astype(np.float64)
        outs.append(h)
    return np.stack(outs)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_another_librarys_file_runs_with_its_outputs_or_is_refused_by_name(path):
    info, run, refused = _read(path)
    if refused is not None:
        assert "node '" in str(refused)
        return
    snn, data = run
    if path.stem in DEPARTS:  # snnconv follows the file's NIR meaning, not the producer's run
        graph = load_nir(path, dt=info["read"]["dt"])
        for kind in ("ties", "random"):
            x = data[f"x_{kind}"]
            with torch.no_grad():
                ours = snn.run(torch.from_numpy(x)).numpy()
            spec = _spec_lif_mlp(graph, x, int(data["T"]), info["read"]["dt"]).reshape(ours.shape)
            assert np.array_equal(ours, spec), kind
        assert not np.array_equal(ours, data["out_random"].reshape(ours.shape)), DEPARTS[path.stem]
        return
    for kind in ("ties", "random"):
        with torch.no_grad():
            ours = snn.run(torch.from_numpy(data[f"x_{kind}"])).numpy()
        theirs = data[f"out_{kind}"].reshape(ours.shape)
        assert np.array_equal(ours, theirs), f"{info['library']} {kind}: {(ours != theirs).sum()} outputs differ"


def test_spikingjelly_norse_and_snntorch_files_run_and_sinabs_is_refused_for_its_reset():
    by_stem = {p.stem: _read(p) for p in FILES}
    for stem in ("spikingjelly_if_mlp", "norse_if_mlp", "norse_lif_mlp", "snntorch_lif_mlp"):
        assert by_stem[stem][2] is None, by_stem[stem][2]
    refused = by_stem["sinabs_if_mlp"][2]
    assert refused is not None and "subtraction" in str(refused) and "nir 1.0.4" in str(refused)


def test_spikingjelly_departs_from_nir_at_ties():
    """spikingjelly simulates v >= v_threshold; read with NIR's '>' its file differs at ties
    only, which is why its fixture is read with compare='>='."""
    path = FIXTURES / "spikingjelly_if_mlp.nir"
    data = np.load(path.with_suffix(".npz"))
    snn = from_nir(load_nir(path, dt=1e-4), T=int(data["T"]), dt=1e-4)
    with torch.no_grad():
        ties = snn.run(torch.from_numpy(data["x_ties"])).numpy()
        rand = snn.run(torch.from_numpy(data["x_random"])).numpy()
    assert not np.array_equal(ties, data["out_ties"].reshape(ties.shape))
    assert np.array_equal(rand, data["out_random"].reshape(rand.shape))
