"""Notebooks 04-05: NIR export and the backends, analysis and report (see build_notebooks.py)."""

from __future__ import annotations

from cells_common import DATA, SETUP, code, intro, md, run_params

# the cell of 04 and 05 that loads the fine-tuned network (notebook 02's where 03 has not run)
LOAD_SNN = '''
snn_file = os.path.join(out_dir, "snn_finetuned.pt")
if not os.path.exists(snn_file):
    require("02_convert", "snn.pt")
    snn_file = os.path.join(out_dir, "snn.pt")
snn = snnconv.SpikingNetwork.load(snn_file)
'''

# --- 04 -----------------------------------------------------------------------------------------

NB04 = [
    intro("04", '''
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
the Loihi model differs by its fixed-point rounding).
'''),
    run_params('''
backends = ["cpu", "gpu", "loihi2-sim", "lava"]   # those not available here are skipped, with the reason
n_images = 256             # test images run on each backend
lava_images = 4            # Lava runs one process per layer and is slow: a few images suffice to compare
batch_size = 64
''', num_workers=0),
    code('''
if dataset == "smoke":
    n_images, batch_size = 32, 32
    backends = [b for b in backends if b != "lava"]  # minutes per image for a ResNet; the backend tests check Lava
AUGMENT = False
'''),
    code(SETUP),
    md('''
This notebook needs the NIR exporter (`snnconv.snn.nir_io`) and the backends (`snnconv_backends`).
If this build lacks them, the next cell stops here with a message instead of faking results.
'''),
    code('''
import importlib.util
missing = [m for m in ("snnconv.snn.nir_io", "snnconv.backends") if importlib.util.find_spec(m) is None]
if missing:
    raise RuntimeError(f"this snnconv build lacks {missing}: notebook 04 needs the NIR exporter "
                       "and the backends; install a release that has them")
import snnconv.backends
from snnconv.snn.prefixfile import load_prefix, save_prefix
'''),
    code(DATA),
    md('''
## Export

`export_nir` writes the network with reset by subtraction as standard NIR primitives
(integrator, threshold and a recurrent scale: exact step for step). Readers that only know
reset-to-zero IF neurons cannot silently misread it. A network whose first layers run once in
analog (a stem with max-pooling, which NIR cannot express) is exported as two files: the graph,
whose input is then the stem's output, and the stem beside it (`save_prefix`); `load_prefix`
reads it back. The ResNets of these notebooks have no such stem, so there is only the graph.
'''),
    code(LOAD_SNN + '''
T = snn.T
graph = snnconv.export_nir(snn)       # the input shape recorded by convert()
nir_path = os.path.join(out_dir, "snn.nir")
prefix_path = save_prefix(snn, graph, nir_path)  # None: no analog prefix
snnconv.save_nir(graph, nir_path)
print(f"exported {snn_file} (T={T}) -> {nir_path} ({os.path.getsize(nir_path) / 1e6:.2f} MB)"
      + (f" and its analog prefix {prefix_path}" if prefix_path else ""))
'''),
    md('''
## Inspect

What the file holds, read back with `snnconv.load_nir`: the metadata says what the graph means
(reset, readout, T); each IF layer is an integrator `I`, a `Threshold` (at theta minus the
initial membrane) and a recurrent `Scale` that subtracts theta after a spike. The table lists
the first nodes in the order the input reaches them.
`snnconv inspect FILE.nir` prints the same from the command line.
'''),
    code('''
from collections import Counter

graph = snnconv.load_nir(nir_path)
print_table(["metadata", "value"], [[k, v] for k, v in graph.metadata.items()])
print()
kinds = Counter(type(node).__name__ for node in graph.nodes.values())
print(f"{len(graph.nodes)} nodes, {len(graph.edges)} edges: "
      + ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
order, following = ["input"], {}   # the nodes in the order the input reaches them
for src, dst in graph.edges:
    following.setdefault(src, []).append(dst)
for name in order:                 # breadth first: the list grows as the loop reads it
    order += [n for n in following.get(name, []) if n not in order]
rows = []
for name in order[:14]:
    node = graph.nodes[name]
    shape = next(iter(node.output_type.values()))
    theta = getattr(node, "threshold", None)
    rows.append([name, type(node).__name__, "x".join(str(int(d)) for d in shape),
                 "" if theta is None else f"{float(theta.min()):.3g} .. {float(theta.max()):.3g}"])
print_table(["node", "NIR type", "output shape", "threshold (min .. max)"], rows + [["...", "", "", ""]])
'''),
    md('''
## Run on every backend available here

Each backend compiles the same graph and runs the same test images for T steps. The reference
is the torch network's prediction; **agreement** is the share of images on which a backend
predicts the same class. Each result is written to `out_dir/backends/NAME.json`.
'''),
    code('''
from snnconv.analysis.activity import backend_record

prefix = load_prefix(graph, nir_path)
x = torch.cat([b[0] for b in test_loader])[:n_images]
y = torch.cat([b[1] for b in test_loader])[:n_images]
with torch.no_grad():
    reference = snn.run(x, T=T).mean(0).argmax(1)
    graph_input = prefix(x) if prefix is not None else x
available = snnconv.backends.available()
results, rows = {}, []
for name in backends:
    ok, reason = available.get(name, (False, "not registered"))
    if not ok:
        print(f"{name} skipped: {reason}")
        continue
    k = lava_images if name == "lava" else len(x)
    t0 = time.perf_counter()
    result = snnconv.backends.get(name).compile(graph).run(graph_input[:k], T=T)
    rec = backend_record(name, result, y[:k], reference[:k], T=T, wall_s=time.perf_counter() - t0)
    results[name] = rec
    os.makedirs(os.path.join(out_dir, "backends"), exist_ok=True)
    with open(os.path.join(out_dir, "backends", f"{name}.json"), "w") as fh:
        json.dump(rec, fh, indent=2)
    rows.append([name, rec["images"], rec["T"], f"{rec['accuracy']:.2f}", f"{rec['agreement']:.2f}",
                 f"{rec['synops_total'] / rec['images'] / 1e6:.2f}", f"{rec['wall_s']:.1f}"])
print()
print_table(["backend", "images", "T", "accuracy (%)", "agreement (%)", "synaptic ops per image (M)",
             "wall time (s)"], rows)
'''),
    md('''
## Resources and energy

A backend that models a chip reports what it would use (cores, neurons, synapses), how its
fixed-point weights round, and an energy estimate. These are the numbers of a **model**, not a
measurement on silicon.
'''),
    code('''
for name, rec in results.items():
    extra = rec.get("extra", {})
    res, energy, quant = extra.get("resources"), extra.get("energy"), extra.get("quantisation")
    if not (res or energy or quant):
        print(f"{name}: an exact executor, no chip model (no resources or energy)")
        continue
    print(f"\\n{name}")
    if res:
        print_table(["layer", "neurons", "synapses in", "cores"],
                    [[layer, r.get("neurons"), r.get("synapses_in"), r.get("cores")]
                     for layer, r in res.get("layers", {}).items()]
                    + [["total", res.get("neurons"), res.get("synapses"), res.get("cores")]])
        lim = res.get("limits", {})
        print(f"{res.get('chips')} chip(s) of {lim.get('cores_per_chip')} cores; per core at most "
              f"{lim.get('neurons_per_core')} neurons and {lim.get('synapses_per_core')} synapses")
    if quant:
        errors = [c.get("rel_error", 0.0) for layer in quant.get("layers", {}).values()
                  for c in layer.get("connections", {}).values()]
        if errors:
            print(f"weight rounding (8-bit mantissa): relative error per connection "
                  f"{100 * min(errors):.2f}% .. {100 * max(errors):.2f}%")
    if energy and "per_image_J" in energy:
        print(f"energy per image: SNN {si(energy['per_image_J'], 'J')}"
              + (f", ANN {si(energy['ann_per_image_J'], 'J')} (SNN/ANN {energy['snn_over_ann']:.2f})"
                 if "ann_per_image_J" in energy else ""))
        print(f"  model: {energy.get('model', '')}")
print("\\nbackends run:", ", ".join(results) or "none")
'''),
]

# --- 05 -----------------------------------------------------------------------------------------

NB05 = [
    intro("05", '''
# 05 What the spiking network does: firing, operations, energy

A spiking network saves energy only if it spikes little: every spike triggers one accumulate
per outgoing synapse, where the ANN does a multiply-accumulate for every connection at every
inference. This notebook counts both on test images, draws a spike raster, estimates energy,
and writes the HTML report of the whole run.
'''),
    run_params('''
T = None                   # None: the T the network was converted for
n_images = 256
batch_size = 64
''', num_workers=0),
    code('''
if dataset == "smoke":
    n_images, batch_size = 32, 32
AUGMENT = False
'''),
    code(SETUP),
    code(DATA),
    code('''
from snnconv.analysis.activity import analyse
''' + LOAD_SNN + '''
snn = snn.to(device)
T = T or snn.T
x = torch.cat([b[0] for b in test_loader])[:n_images].to(device)
stats = analyse(snn, x, T=T)
print(f"{snn_file}: {len(stats.firing_rate)} IF layers, T={stats.T}, {stats.batch} test images")
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
ax.set_ylabel("spikes per neuron per step (%)"); ax.set_title(f"firing rate, T={T}")
ax.grid(axis="y", alpha=0.3)
plt.show()
'''),
    md('''
## Synaptic operations against MACs

Per weight layer and image: the ANN's multiply-accumulates (once) against the SNN's
accumulates over all T steps. The first layer sees the analog image (direct encoding) and does
MACs once, like the ANN.
'''),
    code('''
layers, n = list(stats.macs), stats.batch
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.bar([i - 0.2 for i in range(len(layers))], [stats.macs[k] / n for k in layers], width=0.4, label="ANN MACs")
ax.bar([i + 0.2 for i in range(len(layers))], [stats.synops.get(k, 0) / n for k in layers], width=0.4,
       label=f"SNN synaptic ops (T={T})")
ax.set_yscale("log"); ax.set_xticks(range(len(layers))); ax.set_xticklabels(layers, rotation=70, fontsize=7)
ax.set_ylabel("operations per image"); ax.legend(); plt.show()
analog = sum(stats.static_macs.values()) + sum(stats.dense_macs.values())
print_table(["per image", "ANN", f"SNN (T={T})"], [
    ["multiply-accumulates (MAC)", f"{sum(stats.macs.values()) / n / 1e6:.2f} M", f"{analog / n / 1e6:.2f} M"],
    ["accumulates (AC, one per spike and synapse)", "0", f"{sum(stats.synops.values()) / n / 1e6:.2f} M"]])
'''),
    md('''
## Energy

The arithmetic estimate at 45 nm (4.6 pJ per float MAC, 0.9 pJ per accumulate; memory traffic,
neuron updates and routing not counted). A backend of notebook 04 that models a chip reports
its own estimate, from other figures: the two are not the same comparison.
'''),
    code('''
e = stats.energy()
print_table(["energy per image", "SNN", "ANN", "SNN / ANN"],
            [["arithmetic, 45 nm", si(e["snn_pj"] * 1e-12, "J"), si(e["ann_pj"] * 1e-12, "J"), f"{e['ratio']:.2f}"]])
backend_dir = os.path.join(out_dir, "backends")
rows = []
for f in sorted(os.listdir(backend_dir)) if os.path.isdir(backend_dir) else []:
    with open(os.path.join(backend_dir, f)) as fh:
        rec = json.load(fh)
    nj = rec.get("energy_per_image_nj")
    rows.append([rec["backend"], rec["images"], si(nj * 1e-9, "J") if nj is not None else "no energy model"])
if rows:
    print()
    print_table(["backend (notebook 04)", "images", "energy per image"], rows)
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
ax.set_xlabel("time step"); ax.set_title(f"spikes of image 0, T={T}"); plt.show()
'''),
    md('''
## The report

Everything above, with notebook 02-04's results, on one self-contained HTML page:
`snnconv report OUT_DIR` writes the same page from the command line.
'''),
    code('''
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.analysis.report import write_report

acc = accuracy_by_T(snn, test_loader, sorted({1, 2, 4, T}), device)
with open(os.path.join(out_dir, "evaluation.json"), "w") as fh:
    json.dump({"network": os.path.basename(snn_file), "images": len(test_set),
               "accuracy": {str(t): a for t, a in acc.items()}, "analysis": stats.to_dict()}, fh, indent=2)
print(f"test accuracy (%) on {len(test_set)} images")
print_table(["T", "accuracy (%)"], [[t, f"{a:.2f}"] for t, a in acc.items()])
report = write_report(out_dir)
print(f"wrote {out_dir}/evaluation.json and {report}")
'''),
]
