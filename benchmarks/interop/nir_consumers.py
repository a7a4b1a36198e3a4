"""NIR both ways with the ecosystem: each library's exporter on its own small networks ->
snnconv, and snnconv's files -> each library's importer, outputs compared element by element
(benchmarks/README.md holds the table).

The libraries' pins clash with ours, so each runs in a throwaway venv layered over the
project's (never in the project's venv itself)::

    PY=/work/venvs; B=$(.venv/bin/python -c "import sys; print(sys.base_prefix)")/bin/python3.11
    for v in eco sinabs; do $B -m venv $PY/nir-$v
      echo "$PWD/.venv/lib/python3.11/site-packages" > $PY/nir-$v/lib/python3.11/site-packages/main.pth; done
    $PY/nir-eco/bin/pip install --no-deps norse==1.1.0 snntorch==1.0.0 rockpool==3.1.0 pbr
    $PY/nir-sinabs/bin/pip install --no-deps sinabs==3.1.3 nir==1.0.4 pbr   # sinabs pins nir <= 1.0.4
    .venv/bin/python -m benchmarks interop nir_consumers --venvs $PY

spikingjelly 2.0.0 is in the project's venv and runs there. Every network sees inputs that
are multiples of 1/4 through weights that are multiples of 1/8 (membranes land exactly on
the threshold: ties) and random floats; the same input is presented at every step.

Run as ``python -m benchmarks interop nir_consumers``; ``--fixtures DIR`` also writes each
library's exports with its own simulation's outputs (``<lib>_<net>.nir`` + ``.npz``) for
tests/test_nir_interop_fixtures.py. The module runs
its own file as ``--side LIB --dir D`` inside each library's venv (that part imports only torch,
numpy, nir and the library; nothing from this package).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

T = 8
FIXTURE_COMMAND = "python -m benchmarks interop nir_consumers --fixtures tests/fixtures/nir"
HERE = Path(__file__).resolve()
#: library -> (venv name under --venvs, or None for the project's interpreter)
LIBS = {"spikingjelly": None, "norse": "nir-eco", "snntorch": "nir-eco", "rockpool": "nir-eco",
        "sinabs": "nir-sinabs"}
#: how snnconv reads each library's files: dt (the step their export assumes) and the
#: comparison their own simulation applies (None: NIR's ">")
#: norse's IAF ignores dt (r = 1 per step); its LIFBox export writes tau = dt / tau_mem_inv, so
#: its own decay dt * tau_mem_inv per step is dt' / tau at dt' = dt**2 = 1e-6; snntorch writes
#: tau = dt / (1 - beta) and r = tau / dt at dt = 1e-4
READ = {"spikingjelly": {"dt": 1e-4, "compare": ">="}, "norse_if": {"dt": 1.0, "compare": None},
        "norse_lif": {"dt": 1e-6, "compare": None}, "snntorch": {"dt": 1e-4, "compare": None},
        "rockpool": {"dt": 1e-3, "compare": None}, "sinabs": {"dt": 1.0, "compare": ">="}}


def _reading(stem: str) -> dict:
    """``READ``'s entry for an export called ``<lib>_<net>``."""
    lib, net = stem.split("_", 1)
    return READ.get(f"{lib}_{net.split('_')[0]}", READ.get(lib))


def _inputs(n_in: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ties": (rng.integers(0, 5, (4, n_in)) / 4).astype(np.float32),
            "random": rng.random((4, n_in), dtype=np.float32)}


def _dyadic(shape, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-4, 9, shape) / 8).astype(np.float32)


# --- inside a library's venv ------------------------------------------------------------------

def _side_export(lib: str):
    """(name, graph, simulate(x [B, N] -> [T, B, M])) for each of ``lib``'s own networks."""
    import torch
    import torch.nn as nn

    def linear(n_in, n_out, seed, bias=False):
        m = nn.Linear(n_in, n_out, bias=bias)
        with torch.no_grad():
            m.weight.copy_(torch.from_numpy(_dyadic((n_out, n_in), seed)))
            if bias:
                m.bias.zero_()
        return m

    sample = torch.zeros(1, 4)
    unbatched = torch.zeros(4)  # NIR shapes have no batch: nirtorch writes the sample's shape
    if lib == "spikingjelly":
        from spikingjelly.activation_based import functional, layer, neuron
        from spikingjelly.activation_based.nir_exchange import export_to_nir

        net = nn.Sequential(layer.Linear(4, 8, bias=True), neuron.IFNode(v_threshold=1.0, v_reset=0.0),
                            layer.Linear(8, 3, bias=True))
        with torch.no_grad():
            net[0].weight.copy_(torch.from_numpy(_dyadic((8, 4), 1)))
            net[2].weight.copy_(torch.from_numpy(_dyadic((3, 8), 2)))
            net[0].bias.zero_()
            net[2].bias.zero_()

        def sim(x):
            functional.reset_net(net)
            return torch.stack([net(x) for _ in range(T)])
        yield "if_mlp", export_to_nir(net, sample), sim
    elif lib == "norse":
        import norse.torch as nt

        # per-neuron parameters: norse's scalar defaults make a file nir.write cannot write
        iaf = nt.IAFCell(nt.IAFParameters(v_th=torch.ones(8), v_reset=torch.zeros(8)))
        box = nt.LIFBoxCell(nt.LIFBoxParameters(tau_mem_inv=torch.full((8,), 100.0), v_leak=torch.zeros(8),
                                                v_th=torch.ones(8), v_reset=torch.zeros(8)))
        net = nt.SequentialState(linear(4, 8, 1, True), iaf, linear(8, 3, 2, True))
        lif = nt.SequentialState(linear(4, 8, 1, True), box, linear(8, 3, 2, True))

        def run(model):
            def sim(x):
                outs, state = [], None
                for _ in range(T):
                    o, state = model(x, state)
                    outs.append(o)
                return torch.stack(outs)
            return sim
        yield "if_mlp", nt.to_nir(net, unbatched), run(net)
        yield "lif_mlp", nt.to_nir(lif, unbatched), run(lif)
    elif lib == "snntorch":
        import snntorch as snn
        from snntorch import utils
        from snntorch.export_nir import export_to_nir

        # per-neuron parameters: with scalar ones snntorch writes LIF nodes of shape () that nir's
        # type check refuses
        net = nn.Sequential(linear(4, 8, 1, True),
                            snn.Leaky(beta=torch.full((8,), 0.5), threshold=torch.ones(8), init_hidden=True),
                            linear(8, 3, 2, True),
                            snn.Leaky(beta=torch.full((3,), 0.5), threshold=torch.ones(3), init_hidden=True,
                                      output=True))

        def sim(x):
            utils.reset(net)
            return torch.stack([net(x)[0] for _ in range(T)])
        yield "lif_mlp", export_to_nir(net, unbatched), sim
    elif lib == "rockpool":
        from rockpool.nn.combinators import Sequential
        from rockpool.nn.modules import LIFTorch, LinearTorch
        from rockpool.nn.modules.torch.nir import to_nir

        net = Sequential(LinearTorch((4, 8), weight=torch.from_numpy(_dyadic((4, 8), 1))), LIFTorch(8),
                         LinearTorch((8, 3), weight=torch.from_numpy(_dyadic((8, 3), 2))), LIFTorch(3))

        def sim(x):
            net.reset_state()
            out, _, _ = net(x.unsqueeze(1).expand(x.shape[0], T, x.shape[1]).contiguous())
            return out.transpose(0, 1)
        yield "lif_mlp", to_nir(net, sample), sim
    elif lib == "sinabs":
        import sinabs
        import sinabs.layers as sl

        net = nn.Sequential(linear(4, 8, 1, True), sl.IAF(), linear(8, 3, 2, True))

        def sim(x):
            for m in net.modules():
                if hasattr(m, "reset_states"):
                    m.reset_states()
            return net(x.unsqueeze(1).expand(x.shape[0], T, x.shape[1]).contiguous()).transpose(0, 1)
        yield "if_mlp", sinabs.to_nir(net, torch.zeros(1, 1, 4)), sim  # sinabs' layers take [B, T, ...]


def _side_consume(lib: str, path: str, x):
    """``lib``'s importer on one of snnconv's files: the per-step readout [T, B, ...]."""
    import nir
    import torch

    graph = nir.read(path)
    if lib == "spikingjelly":
        from spikingjelly.activation_based.nir_exchange import import_from_nir

        net = import_from_nir(path, dt=1.0)
        outs, state = [], None
        for _ in range(T):
            out, state = net(x, state)
            outs.append(out)
        return torch.stack(outs)
    if lib in ("norse", "snntorch"):
        if lib == "norse":
            import norse.torch as nt
            net = nt.from_nir(graph, dt=1.0)
        else:
            from snntorch.import_nir import import_from_nir
            net = import_from_nir(graph)
        outs, state = [], None
        for _ in range(T):
            r = net(x, state) if state is not None else net(x)
            o, state = r if isinstance(r, tuple) else (r, None)
            outs.append(o)
        return torch.stack(outs)
    if lib == "rockpool":
        from rockpool.nn.modules.torch.nir import from_nir

        net = from_nir(graph)
        out = net(x.unsqueeze(1).expand(x.shape[0], T, *x.shape[1:]).contiguous())
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1)
    if lib == "sinabs":
        import sinabs

        net = sinabs.from_nir(graph, batch_size=x.shape[0])
        xs = x.unsqueeze(1).expand(x.shape[0], T, *x.shape[1:]).reshape(x.shape[0] * T, *x.shape[1:])
        r = net(xs)
        r = r[0] if isinstance(r, tuple) else r
        return r.reshape(x.shape[0], T, -1).transpose(0, 1)
    raise ValueError(lib)


def side(lib: str, root: Path) -> None:
    import nir
    import torch

    warnings.filterwarnings("ignore")
    out = root / lib
    out.mkdir(parents=True, exist_ok=True)
    import importlib.metadata as md

    report: dict = {"export": {}, "consume": {}, "versions": {p: md.version(p) for p in (lib, "nir")}}
    exports = _side_export(lib)
    while True:
        try:
            name, graph, sim = next(exports)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 (the library's own exporter failing is a result)
            report["export"]["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
        path = out / f"{lib}_{name}.nir"
        try:
            nir.write(str(path), graph)
            runs = {}
            with torch.no_grad():
                for kind, x in _inputs(4).items():
                    runs[kind] = sim(torch.from_numpy(x)).detach().numpy()
        except Exception as exc:  # noqa: BLE001
            path.unlink(missing_ok=True)  # nir.write leaves a partial file when it fails
            report["export"][f"error {name}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        np.savez(out / f"{lib}_{name}.npz", T=T, **{f"x_{k}": v for k, v in _inputs(4).items()},
                 **{f"out_{k}": v for k, v in runs.items()})
        report["export"][name] = "ok"
    for path in sorted((root / "ours").glob("*.nir")):
        data = np.load(path.with_suffix(".npz"))
        for B in (1, 4):
            key = f"{path.stem} B={B}"
            try:
                with torch.no_grad():
                    theirs = _side_consume(lib, str(path), torch.from_numpy(data["x"][:B]))
                np.save(out / f"consume_{path.stem}_B{B}.npy", theirs.detach().numpy())
                report["consume"][key] = "ran"
            except Exception as exc:  # noqa: BLE001 (a refusal or crash is the result)
                first = str(exc).splitlines()[0][:160] if str(exc) else ""
                report["consume"][key] = f"{type(exc).__name__}: {first}"
    (out / "report.json").write_text(json.dumps(report, indent=1))


# --- in the project's venv --------------------------------------------------------------------

def _our_files(root: Path) -> None:
    """snnconv's files: hard-reset networks (tie MLP, conv-MLP, SmallCNN, ResNet-8 with identity
    shortcuts) and one subtractive, with inputs and snnconv's own per-step readouts."""
    import nir
    import torch

    import snnconv
    from snnconv.nir.format import neuron_metadata, spec_threshold
    from snnconv.snn.nir_io import export_nir, from_nir, save_nir

    from ..common import test_helper

    narrow = test_helper("_zoo").NARROW

    def _convert(name, shape, *, T, reset="subtract"):  # a narrow zoo network on random data
        torch.manual_seed(0)
        x = torch.rand(8, *shape)
        snn, _ = snnconv.convert(narrow[name](shape[0]), [(x, torch.zeros(8, dtype=torch.long))], T=T, L=4,
                                 calib_batches=1, bias_calibration=False, maxpool="avg", reset=reset,
                                 progress=False, on_collapse="warn")
        return snn

    out = root / "ours"
    out.mkdir(parents=True, exist_ok=True)
    # a network whose membranes reach theta exactly: dyadic weights, inputs in quarters
    meta = neuron_metadata("zero", 0.0, per_channel=False)
    nodes = {"input": nir.Input(np.array([4])),
             "fc1": nir.Affine(weight=_dyadic((8, 4), 1), bias=np.zeros(8, np.float32)),
             "if1": nir.IF(r=np.ones(8, np.float32), v_threshold=spec_threshold(np.ones(8, np.float32)),
                           v_reset=np.zeros(8, np.float32), metadata=meta),
             "fc2": nir.Affine(weight=_dyadic((3, 8), 2), bias=np.zeros(3, np.float32)),
             "output": nir.Output(np.array([3]))}
    tie = from_nir(nir.NIRGraph(nodes=nodes, edges=[("input", "fc1"), ("fc1", "if1"), ("if1", "fc2"),
                                                    ("fc2", "output")], type_check=False), T=T)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 8 * 8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    xc = torch.rand(16, 1, 8, 8)
    cmlp, _ = snnconv.convert(m, [(xc, torch.zeros(16, dtype=torch.long))], T=T, L=4, calib_batches=1,
                              bias_calibration=False, reset="zero", progress=False)
    nets = {"hard_tie_mlp": (tie, torch.from_numpy(_inputs(4)["ties"])),
            "hard_conv_mlp": (cmlp, torch.rand(4, 1, 8, 8)),
            "hard_small_cnn": (_convert("small_cnn", (1, 8, 8), reset="zero", T=T), torch.rand(4, 1, 8, 8)),
            "hard_resnet8": (_convert("resnet8", (3, 16, 16), reset="zero", T=T), torch.rand(4, 3, 16, 16)),
            "subtract_small_cnn": (_convert("small_cnn", (1, 8, 8), T=T), torch.rand(4, 1, 8, 8))}
    for name, (snn, x) in nets.items():
        save_nir(export_nir(snn), out / f"{name}.nir")
        with torch.no_grad():
            ours = snn.run(x, T=T)
        np.savez(out / f"{name}.npz", x=x.numpy(), out=ours.numpy())


def _compare(theirs: np.ndarray, ours: np.ndarray) -> tuple[str, str]:
    if theirs.size != ours.size:
        return "differs", f"shape {theirs.shape} vs {ours.shape}"
    theirs = theirs.reshape(ours.shape)
    bad = ~np.isclose(theirs, ours, rtol=1e-5, atol=1e-6)
    if not bad.any():
        return "equal", "bit for bit" if np.array_equal(theirs, ours) else "within float rounding (1e-5)"
    return "differs", f"{int(bad.sum())} of {bad.size} outputs"


def read_theirs(lib: str, nir_path: Path) -> dict[str, tuple[str, str]]:
    """snnconv reading one of ``lib``'s files (with that library's dt and comparison, and with
    NIR's own comparison): per input kind, (verdict, detail)."""
    import torch

    from snnconv.errors import SnnconvError
    from snnconv.snn.nir_io import from_nir, load_nir

    data = np.load(nir_path.with_suffix(".npz"))
    res = {}
    read = _reading(nir_path.stem)
    for how, opts in (("their convention", read), ("NIR's '>'", {**read, "compare": None})):
        try:
            snn = from_nir(load_nir(nir_path, dt=opts["dt"]), T=T, dt=opts["dt"], compare=opts["compare"])
        except SnnconvError as exc:
            res[how] = ("refused", str(exc).splitlines()[0][:220])
            continue
        verdicts = []
        for kind in ("ties", "random"):
            with torch.no_grad():
                ours = snn.run(torch.from_numpy(data[f"x_{kind}"]), T=T).numpy()
            v, d = _compare(data[f"out_{kind}"], ours)
            verdicts.append((kind, v, d))
        worst = "differs" if any(v == "differs" for _, v, _ in verdicts) else "equal"
        res[how] = (worst, "; ".join(f"{k}: {v} ({d})" for k, v, d in verdicts))
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venvs", default="/work/venvs", help="folder holding nir-eco and nir-sinabs")
    ap.add_argument("--dir", default="/tmp/snnconv-nir-matrix", help="scratch folder")
    ap.add_argument("--libs", nargs="+", default=list(LIBS))
    ap.add_argument("--fixtures", help="also copy each library's exports and outputs here")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if args.side:
        side(args.side, root)
        return
    warnings.filterwarnings("ignore")
    shutil.rmtree(root, ignore_errors=True)
    _our_files(root)
    rows = []
    for lib in args.libs:
        venv = LIBS[lib]
        py = sys.executable if venv is None else str(Path(args.venvs) / venv / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([py, str(HERE), "--side", lib, "--dir", str(root)], env=env,
                              capture_output=True, text=True, timeout=1800)
        rep_path = root / lib / "report.json"
        if not rep_path.exists():
            rows.append((lib, "both", "refused", f"side process failed: {proc.stderr[-300:]}"))
            continue
        rep = json.loads(rep_path.read_text())
        for key, err in rep["export"].items():
            if key.startswith("error"):
                rows.append((lib, f"{lib} {key[6:] or 'export'} -> snnconv", "refused",
                             f"{lib}'s own exporter or simulation fails: {err}"))
        for path in sorted((root / lib).glob(f"{lib}_*.nir")):
            for how, (verdict, detail) in read_theirs(lib, path).items():
                rows.append((lib, f"{path.stem} -> snnconv ({how})", verdict, detail))
            if args.fixtures:
                fixtures = Path(args.fixtures)
                fixtures.mkdir(parents=True, exist_ok=True)
                for suffix in (".nir", ".npz"):
                    shutil.copy(path.with_suffix(suffix), fixtures / path.with_suffix(suffix).name)
                (fixtures / f"{path.stem}.json").write_text(json.dumps(
                    {"library": lib, "versions": rep["versions"], "read": _reading(path.stem),
                     "command": FIXTURE_COMMAND}, indent=1) + "\n")
        for key, status in rep["consume"].items():
            stem, b = key.split(" B=")
            if status != "ran":
                rows.append((lib, f"snnconv {key} -> {lib}", "refused", status))
                continue
            theirs = np.load(root / lib / f"consume_{stem}_B{b}.npy")
            ours = np.load(root / "ours" / f"{stem}.npz")["out"][:, :int(b)]
            verdict, detail = _compare(theirs, ours)
            rows.append((lib, f"snnconv {key} -> {lib}", verdict, detail))
    print("| library | direction | result | detail |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")


if __name__ == "__main__":
    main()
