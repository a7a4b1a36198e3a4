"""Notebooks 04-05: NIR export and the backends, analysis and report (see build_notebooks.py)."""

from __future__ import annotations

from cells_common import DATA, SETUP, code, md, run_params


# --- 04 -----------------------------------------------------------------------------------------

NB04 = [
    md('''
# 04 NIR and the backends

The fine-tuned network leaves PyTorch as a **NIR graph** (the Neuromorphic Intermediate
Representation, an HDF5 file). A backend takes that graph and nothing else:

| backend | what it is | what it is not |
|---|---|---|
| `cpu` | the exact reference executor (numpy/torch, float32) | fast |
| `gpu` | the same on CUDA | available without a GPU |
| `loihi2-sim` | a vectorised fixed-point **model** of Loihi 2 (weight quantisation, integer membranes) | Loihi 2 silicon: its resources and energy are estimates |
| `lava` | the graph run in Intel's Lava (bit-accurate Loihi 2 process models), a side environment | a chip either |

What to look at: every backend should agree with the torch network (agreement 100% for cpu/gpu;
the Loihi model differs by its documented quantisation error).
'''),
    run_params('''
T = 8
backends = ["cpu", "gpu", "loihi2-sim", "lava"]   # those not available here are skipped, with the reason
n_images = 256             # images run on each backend
lava_images = 4            # Lava runs one process per layer and is slow: a few images suffice to compare
batch_size = 64
''', num_workers=0),
    code('''
if dataset == "smoke":
    T, n_images, batch_size = 4, 32, 32
    backends = [b for b in backends if b != "lava"]  # minutes per image for a ResNet; the backend tests check Lava
AUGMENT = False
'''),
    code(SETUP),
    md('''
This notebook needs the NIR exporter (`snnconv.nir_io`) and the backends (`snnconv_backends`).
If this build lacks them, the next cell stops here with a message instead of faking results.
'''),
    code('''
import importlib.util
missing = [m for m in ("snnconv.nir_io", "snnconv.backends") if importlib.util.find_spec(m) is None]
if missing:
    raise RuntimeError(f"this snnconv build lacks {missing}: notebook 04 needs the NIR exporter "
                       "and the backends; install a release that has them")
from snnconv import nir_io
import snnconv.backends
'''),
    code(DATA),
    md('''
## Export

`export_nir` writes the network with reset by subtraction as standard NIR primitives
(integrator, threshold and a recurrent scale: exact step for step). Readers that only know
reset-to-zero IF neurons cannot silently misread it.
'''),
    code('''
snn_file = os.path.join(out_dir, "snn_finetuned.pt")
if not os.path.exists(snn_file):
    require("02_convert", "snn.pt")
    snn_file = os.path.join(out_dir, "snn.pt")
snn = snnconv.SpikingNetwork.load(snn_file)
graph = nir_io.export_nir(snn, input_shape=tuple(test_set[0][0].shape))  # batch-free (C, H, W)
nir_path = os.path.join(out_dir, "snn.nir")
nir_io.save_nir(graph, nir_path)
print(f"exported {snn_file} -> {nir_path} ({os.path.getsize(nir_path) / 1e6:.2f} MB)")
'''),
    md('''
## Inspect

The strict reader every backend uses: one op per node in topological order, with shapes and
thresholds. The metadata says what the graph means (reset, initial membrane, readout).
'''),
    code('''
from snnconv_backends.nirgraph import parse

parsed = parse(nir_io.load_nir(nir_path))
print("metadata:", dict(parsed.metadata))
kinds = {}
for op in parsed.ops:
    kinds[op.kind] = kinds.get(op.kind, 0) + 1
print("ops:", kinds)
for op in parsed.ops[:12]:
    print(f"  {op.kind:10} {op.name:28} {op.out_shape}")
'''),
    md('''
## Run on every backend available here

Each backend compiles the same graph and runs the same images for T steps. The reference is
the torch network's prediction; `agreement` is the share of images on which a backend predicts
the same class.
'''),
    code('''
from snnconv.analysis import backend_record

x = torch.cat([b[0] for b in test_loader])[:n_images]
y = torch.cat([b[1] for b in test_loader])[:n_images]
with torch.no_grad():
    reference = snn.run(x, T=T).mean(0).argmax(1)
available = snnconv.backends.available()
results = {}
for name in backends:
    ok, reason = available.get(name, (False, "not registered"))
    if not ok:
        print(f"{name:11} skipped: {reason}")
        continue
    k = lava_images if name == "lava" else len(x)
    t0 = time.perf_counter()
    result = snnconv.backends.get(name).compile(nir_io.load_nir(nir_path)).run(x[:k], T=T)
    rec = backend_record(name, result, y[:k], reference[:k], T=T, wall_s=time.perf_counter() - t0)
    results[name] = rec
    os.makedirs(os.path.join(out_dir, "backends"), exist_ok=True)
    with open(os.path.join(out_dir, "backends", f"{name}.json"), "w") as fh:
        json.dump(rec, fh, indent=2)
    print(f"{name:11} accuracy {rec['accuracy']:.2f}%, agreement {rec['agreement']:.2f}%, "
          f"{rec['synops_total']:.3g} synaptic ops, {rec['wall_s']:.1f} s")
'''),
    md('''
## Resources and energy

A backend that models a chip reports what it would use (cores, synapse memory) and an energy
estimate. These are the numbers of a **model**, not a measurement on silicon.
'''),
    code('''
for name, rec in results.items():
    extra = rec.get("extra", {})
    for key in ("resources", "energy", "quantization"):
        if key in extra:
            print(f"{name} {key}: {json.dumps(extra[key], default=str)[:400]}")
print("backends run:", list(results))
'''),
]

# --- 05 -----------------------------------------------------------------------------------------

NB05 = [
    md('''
# 05 What the spiking network does: firing, operations, energy

A spiking network saves energy only if it spikes little: every spike triggers one accumulate
per outgoing synapse, where the ANN does a multiply-accumulate for every connection at every
inference. This notebook counts both on test images, draws a spike raster, estimates energy,
and writes the HTML report of the whole run.
'''),
    run_params('''
T = 8
n_images = 256
batch_size = 64
''', num_workers=0),
    code('''
if dataset == "smoke":
    T, n_images, batch_size = 4, 32, 32
AUGMENT = False
'''),
    code(SETUP),
    code(DATA),
    code('''
from snnconv.analysis import analyse

snn_file = os.path.join(out_dir, "snn_finetuned.pt")
if not os.path.exists(snn_file):
    require("02_convert", "snn.pt")
    snn_file = os.path.join(out_dir, "snn.pt")
snn = snnconv.SpikingNetwork.load(snn_file).to(device)
x = torch.cat([b[0] for b in test_loader])[:n_images].to(device)
stats = analyse(snn, x, T=T)
print(f"{snn_file}: {len(stats.firing_rate)} IF layers, T={stats.T}, {stats.batch} images")
'''),
    md('''
## Firing rate per layer

The share of neurons that spike at a step, per layer. Typical converted networks sit between 1%
and 20%; a layer near 0 carries almost no information (its threshold may be too high), a layer
near 50% or more costs many operations.
'''),
    code('''
names = list(stats.firing_rate)
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.bar(range(len(names)), [100 * stats.firing_rate[n] for n in names])
ax.set_xticks(range(len(names))); ax.set_xticklabels(names, rotation=70, fontsize=7)
ax.set_ylabel("spikes per neuron per step (%)"); ax.grid(axis="y", alpha=0.3)
plt.show()
'''),
    md('''
## Synaptic operations against MACs

Per weight layer: the ANN's multiply-accumulates for these images (once) against the SNN's
accumulates over all T steps. The first layer sees the analog image (direct encoding) and does
MACs once, like the ANN.
'''),
    code('''
layers = list(stats.macs)
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.bar([i - 0.2 for i in range(len(layers))], [stats.macs[n] for n in layers], width=0.4, label="ANN MACs")
ax.bar([i + 0.2 for i in range(len(layers))], [stats.synops.get(n, 0) for n in layers], width=0.4,
       label=f"SNN synaptic ops (T={T})")
ax.set_yscale("log"); ax.set_xticks(range(len(layers))); ax.set_xticklabels(layers, rotation=70, fontsize=7)
ax.legend(); plt.show()
print(f"total: {sum(stats.macs.values()):.3g} MACs (ANN) vs {sum(stats.synops.values()):.3g} synaptic ops "
      f"+ {sum(stats.static_macs.values()):.3g} MACs in the first layer (SNN)")
'''),
    md('''
## Energy

A 45 nm arithmetic estimate (4.6 pJ per float MAC, 0.9 pJ per accumulate; memory traffic not
counted). Backend results from notebook 04 are listed when present: a chip model reports its own
estimate.
'''),
    code('''
e = stats.energy()
print(f"per image: SNN {e['snn_pj'] / 1e3:.1f} nJ, ANN {e['ann_pj'] / 1e3:.1f} nJ (ratio {e['ratio']:.2f})")
backend_dir = os.path.join(out_dir, "backends")
for f in sorted(os.listdir(backend_dir)) if os.path.isdir(backend_dir) else []:
    with open(os.path.join(backend_dir, f)) as fh:
        rec = json.load(fh)
    print(f"backend {rec['backend']}: energy per image {rec.get('energy_per_image_nj', 'not reported')} nJ")
'''),
    md('''
## Spike raster

The first 64 neurons of each layer for the first image: a dot per spike. Early layers fire
from the first steps; deeper layers start later (their input needs a few steps to build up),
which is where the accuracy at very small T is lost.
'''),
    code('''
fig, ax = plt.subplots(figsize=(8, 0.3 * len(stats.raster) + 1.5))
for i, (name, pts) in enumerate(stats.raster.items()):
    if pts:
        ax.scatter([p[0] + 1 for p in pts], [i * 64 + p[1] for p in pts], s=4, marker="|")
ax.set_yticks([i * 64 + 32 for i in range(len(stats.raster))]); ax.set_yticklabels(list(stats.raster), fontsize=7)
ax.set_xlabel("time step"); plt.show()
'''),
    md('''
## The report

Everything above, with notebook 02-04's results, on one self-contained HTML page:
`snnconv report OUT_DIR` writes the same page from the command line.
'''),
    code('''
from snnconv.metrics import accuracy_by_T
from snnconv.report import write_report

acc = accuracy_by_T(snn, test_loader, sorted({1, 2, 4, T}), device)
with open(os.path.join(out_dir, "evaluation.json"), "w") as fh:
    json.dump({"network": os.path.basename(snn_file), "accuracy": {str(t): a for t, a in acc.items()},
               "analysis": stats.to_dict()}, fh, indent=2)
report = write_report(out_dir)
print(f"wrote {out_dir}/evaluation.json and {report}")
'''),
]
