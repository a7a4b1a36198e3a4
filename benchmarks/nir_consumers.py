"""What norse 1.1.0 and sinabs 3.1.3 compute from snnconv's NIR files (benchmarks/README.md).

Their pins clash with ours, so they run in a throwaway venv layered over the project's:

    python3 -m venv /tmp/venv-norse
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/venv-norse/lib/python3.11/site-packages/main.pth
    /tmp/venv-norse/bin/pip install --no-deps norse==1.1.0 sinabs==3.1.3 pbr
    PYTHONPATH=$PWD /tmp/venv-norse/bin/python benchmarks/nir_consumers.py

Prints, per file (hard/subtractive reset; zoo SmallCNN and ResNet-8, and a conv-MLP without
pooling) and batch size, whether each consumer loads it and whether its per-step readout equals
snnconv's.
"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, nir
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_nir import _convert, _trace
from snnconv.nir_io import export_nir, save_nir
torch.manual_seed(0)
cases = {}
for label, name, shape, reset in [("hard small_cnn", "small_cnn", (1,8,8), "zero"),
                                  ("subtract small_cnn", "small_cnn", (1,8,8), "subtract"),
                                  ("hard resnet8", "resnet8", (3,16,16), "zero")]:
    snn = _convert(name, shape, reset=reset)
    path = f"/tmp/snnconv-consumers-{label.replace(' ','_')}.nir"
    save_nir(export_nir(snn), path)
    cases[label] = (snn, path, shape)

import snnconv, torch.nn as nn
for reset in ("zero", "subtract"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 10))
    xc = torch.rand(16, 1, 8, 8)
    snn, _ = snnconv.convert(m, [(xc, torch.zeros(16, dtype=torch.long))], T=4, L=4, calib_batches=1,
                             bias_calibration=False, reset=reset, progress=False)
    label = f"{'hard' if reset == 'zero' else 'subtract'} conv-mlp"
    path = f"/tmp/snnconv-consumers-{label.replace(' ','_')}.nir"
    save_nir(export_nir(snn), path)
    cases[label] = (snn, path, (1, 8, 8))

def run_stateful(net, x, T):
    outs, state = [], None
    for _ in range(T):
        r = net(x, state) if state is not None else net(x)
        if isinstance(r, tuple):
            o, state = r
        else:
            o = r
        outs.append(o)
    return torch.stack(outs)

def norse_load(path):
    import norse.torch as nt
    return nt.from_nir(nir.read(path), dt=1.0)

def sinabs_load(path, B, T):
    import sinabs
    return sinabs.from_nir(nir.read(path), batch_size=B)

T = 8
for label, (snn, path, shape) in cases.items():
    for B in (1, 4):
        x = torch.rand(B, *shape)
        ours, _ = _trace(snn, x, T)
        for consumer in ("norse", "sinabs"):
            try:
                if consumer == "norse":
                    net = norse_load(path)
                    with torch.no_grad():
                        theirs = run_stateful(net, x, T)
                else:
                    net = sinabs_load(path, B, T)
                    with torch.no_grad():
                        # sinabs squeeze layers take [B*T, ...] (batch and time folded)
                        xs = x.unsqueeze(1).expand(B, T, *shape).reshape(B * T, *shape)
                        r = net(xs)
                        r = r[0] if isinstance(r, tuple) else r
                        theirs = r.reshape(B, T, -1).transpose(0, 1)
                theirs = theirs.reshape(ours.shape)
                same = torch.equal(theirs, ours)
                print(f"{consumer:6} {label:20} B={B}: loads; equal={same} max|diff|={(theirs-ours).abs().max().item():.4g} mean|ours|={ours.abs().mean().item():.4g}")
            except Exception as e:
                print(f"{consumer:6} {label:20} B={B}: {type(e).__name__}: {str(e)[:160]}")
