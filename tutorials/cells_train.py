"""Notebooks 01-03: train the ResNet-18, convert it, fine-tune it (see build_notebooks.py)."""

from __future__ import annotations

from cells_common import DATA, SETUP, code, intro, md, params, run_params

# the cell of 02 and 03 that loads notebook 01's ANN
LOAD_ANN = '''
require("01_train_resnet18_cifar10", "ann.json", "ann.pt")
with open(os.path.join(out_dir, "ann.json")) as fh:
    ann_info = json.load(fh)
model = models.get(ann_info["model"], num_classes=10, in_channels=ann_info["in_channels"])
model.load_state_dict(torch.load(os.path.join(out_dir, "ann.pt"), map_location="cpu", weights_only=True))
model.eval()
print(f"loaded {ann_info['model']} ({ann_info['test_accuracy']:.2f}% on {ann_info.get('test_images', '?')} test images)")
'''

# --- 01 -----------------------------------------------------------------------------------------

NB01 = [
    intro("01", '''
# 01 Train a ResNet-18 on CIFAR-10

The network we will convert into a spiking network: a CIFAR-style ResNet-18 (3x3 stem, no
max-pooling, four stages of two BasicBlocks, 64 to 512 channels, **BatchNorm after every
convolution**, ReLU). snnconv does not need you to train it in any special way: a standard
recipe, standard BatchNorm, plain ReLU.

**The recipe** (the usual one for this network): SGD with Nesterov momentum 0.9, learning rate
0.1, weight decay 5e-4, batch 128, a one-cycle cosine schedule over 200 epochs, random crop
(padding 4) and horizontal flip. On one GPU it reaches about **95% test accuracy** (94.5-95.5%
across seeds in the literature for this architecture and schedule). With bfloat16 autocast
expect roughly 10-20 s per epoch on a recent data-centre GPU. Fewer epochs trade accuracy for
time: 30 epochs land near 93%.
'''),
    params('''
dataset = "cifar10"        # "smoke" | "fashion_mnist" | "cifar10"
out_dir = "runs/tutorial"  # every notebook reads and writes its files here
data_root = "data/cifar10"
model_name = "resnet18"    # any name of snnconv.models.names()
epochs = 200
batch_size = 128
lr = 0.1
weight_decay = 5e-4
train_limit = None         # use only the first N training images
test_limit = None
num_workers = 4            # loader processes for CIFAR-10 (the others are in memory)
device = "auto"            # "auto": cuda when available
seed = 0
'''),
    md('''
The smoke setting shrinks everything; the code path is the same (ResNet-8 is the same
`CifarResNet` class with one block per stage and 16 to 64 channels).
'''),
    code('''
if dataset == "smoke":
    model_name, epochs, batch_size, num_workers = "resnet8", 4, 32, 0
AUGMENT = True   # random crop + flip for the training split of CIFAR-10
'''),
    code(SETUP),
    md('''
## Data

CIFAR-10 comes through torchvision (normalised with the usual channel means and deviations,
augmented with crop and flip for training). Check the counts: 50000 / 10000 for CIFAR-10,
60000 / 10000 for Fashion-MNIST (fewer with `train_limit`).
'''),
    code(DATA),
    md('''
## The model

Count the BatchNorm layers: each will be folded into the convolution before it during
conversion (notebook 02). Nothing here is spiking yet.
'''),
    code('''
model = models.get(model_name, num_classes=10, in_channels=in_channels).to(device)
n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
print(f"{model_name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
      f"{n_bn} BatchNorm layers")
'''),
    md('''
## Training

A plain loop so that you can see every choice: SGD + Nesterov, the learning rate per step,
bfloat16 autocast on a GPU. The checkpoint (`ann.pt`, a state dict) is written to a temporary
file and renamed after every epoch, so an interrupted run leaves a usable file.
'''),
    code('''
from snnconv.analysis.metrics import evaluate

opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
steps = epochs * len(train_loader)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15,
                                            anneal_strategy="cos")
use_amp = device.startswith("cuda")
test_every = max(1, epochs // 10)  # about ten test points over the run
history = []

def save_state(model, path):
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)  # the old file stays whole until the new one is

for epoch in range(epochs):
    model.train()
    t0, total, correct, loss_sum = time.perf_counter(), 0, 0, 0.0
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            out = model(x)
            loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        total += len(y)
        correct += (out.argmax(1) == y).sum().item()
        loss_sum += loss.item() * len(y)
    test_acc = evaluate(model, test_loader, device) if (epoch + 1) % test_every == 0 or epoch + 1 == epochs else None
    history.append({"epoch": epoch + 1, "loss": loss_sum / total, "train_acc": 100 * correct / total,
                    "test_acc": test_acc, "seconds": time.perf_counter() - t0})
    save_state(model, os.path.join(out_dir, "ann.pt"))
    print(f"epoch {epoch + 1}/{epochs}: loss {loss_sum / total:.3f}, train {100 * correct / total:.1f}%"
          + (f", test {test_acc:.2f}%" if test_acc is not None else "")
          + f" ({history[-1]['seconds']:.0f} s)")
'''),
    md('''
## What to look at

The training loss should fall steadily and the test accuracy rise to about 95% at the end of
the schedule for CIFAR-10 (about 90% for Fashion-MNIST's short run). A test accuracy far below
the training accuracy means overfitting (check that augmentation is on); a loss that does not
move means a wrong learning rate or unnormalised inputs.
'''),
    code('''
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([h["epoch"] for h in history], [h["train_acc"] for h in history], label="train")
pts = [(h["epoch"], h["test_acc"]) for h in history if h["test_acc"] is not None]
ax.plot(*zip(*pts), marker="o", label=f"test ({len(test_set)} images)")
ax.set_xlabel("epoch"); ax.set_ylabel("accuracy (%)"); ax.grid(alpha=0.3); ax.legend()
ax.set_title(f"{model_name} on {dataset}")
plt.show()

ann_accuracy = evaluate(model, test_loader, device)
with open(os.path.join(out_dir, "ann.json"), "w") as fh:
    json.dump({"model": model_name, "dataset": dataset, "in_channels": in_channels,
               "test_accuracy": ann_accuracy, "test_images": len(test_set), "history": history}, fh, indent=2)
print(f"ANN test accuracy {ann_accuracy:.2f}% on {len(test_set)} images; wrote {out_dir}/ann.pt and ann.json")
'''),
]

# --- 02 -----------------------------------------------------------------------------------------

NB02 = [
    intro("02", '''
# 02 Convert the ANN into a spiking network

`snnconv.convert` runs the whole pipeline on a copy of the trained network:
**fold BatchNorm -> QCFS thresholds -> IF neurons -> BPTT fine-tuning**, with a no-BatchNorm
guard between every two stages. This notebook looks at the first steps one at a time, then
calls `convert()` with its defaults but one: `finetune_epochs=0` stops it before the
fine-tuning, so that you see what the conversion gives without training; notebook 03 runs
`convert()` with all its defaults and shows what the fine-tuning adds. A second call shows what
one setting changes: one threshold per layer instead of one per channel.
'''),
    run_params('''
T = 4                      # time steps of the spiking network (the default of convert(): 8)
eval_T = [1, 2, 4, 8, 16, 32]   # the T values at which the test accuracy is measured
reconstruction_steps = None     # None: the default of convert() (300 here: T <= 8, no fine-tuning)
compare_per_layer = True   # convert a second time with one threshold per layer, to compare
batch_size = 128
''', num_workers=4),
    code('''
if dataset == "smoke":
    eval_T, reconstruction_steps, batch_size, num_workers = [1, 2, 4, 8], 10, 32, 0
AUGMENT = False  # calibration sees the training images as they are
'''),
    code(SETUP),
    code(DATA),
    md('''
## Load the checkpoint of notebook 01

`ann.pt` is a plain state dict, read with `torch.load(..., weights_only=True)`: loading it never
runs code from the file.
'''),
    code(LOAD_ANN),
    md('''
## BatchNorm must go first

The guard `snnconv.assert_no_batchnorm` refuses a network that still holds BatchNorm, and names
every offender: that is what it prints for the trained ANN. BatchNorm statistics were fit on
analog activations; left in a spiking network they would be a second, drifting affine map.
'''),
    code('''
try:
    snnconv.assert_no_batchnorm(model)
except snnconv.BatchNormRemainsError as err:
    print(f"refused, as expected: {len(err.offenders)} BatchNorm layers, e.g.")
    for o in err.offenders[:3]:
        print("  -", o)
'''),
    md('''
## Fold, and check the fold

`fold_batchnorm` merges each BatchNorm into the convolution before it (in float64) and records
the largest output difference it measured per pair. Look at the numbers: they should be at float
rounding level (around 1e-6 or below), and the folded network's accuracy (in the table below)
the ANN's.
'''),
    code('''
x_check = next(iter(test_loader))[0][:16]
folded = snnconv.fold_batchnorm(model, x_check)
snnconv.assert_no_batchnorm(folded)          # passes now
diffs = [p["max_abs_diff"] for p in folded.meta["folded"]]
print(f"{len(diffs)} pairs folded; largest difference per pair: {max(diffs):.2e}")
with torch.no_grad():
    print(f"whole-network max |ANN - folded| on a batch: {(model(x_check) - folded(x_check)).abs().max():.2e}")
'''),
    md('''
## The pipeline in one call

`convert` repeats the fold (on its own copy), calibrates one QCFS threshold per channel of every
ReLU call site from the training images, replaces each ReLU by an IF neuron with reset by
subtraction, calibrates biases and initial membranes, and evaluates on the test set at every T
in `eval_T` (the test set is never used to choose anything).

The one setting changed here is `finetune_epochs=0`. With it `convert()` does not fine-tune,
and at T <= 8 fits each IF layer to the QCFS-ANN instead (300 SGD steps on the calibration
images, no labels read; the smoke setting shortens this to 10 steps with
`reconstruction_steps`, which is otherwise left at its default, `None`). The settings
`convert()` resolved from its defaults are printed first.
'''),
    code('''
t0 = time.perf_counter()
snn, meta = snnconv.convert(model, train_loader, T=T, finetune_epochs=0, reconstruction_steps=reconstruction_steps,
                            eval_loader=test_loader, eval_T=eval_T, seed=seed, device=device)
s = meta.settings
print(f"converted in {time.perf_counter() - t0:.0f} s")
print_table(["setting", "value", "why"], [
    ["T", s["T"], "given"],
    ["per_channel", s["per_channel"], "default for reset by subtraction"],
    ["L (QCFS levels)", s["L"], "default: T"],
    ["finetune_epochs", s["finetune_epochs"], "given: 0"],
    ["reconstruction_steps", s["reconstruction_steps"], s.get("reconstruction_default", "given")]])
print()
print_table(["stage", "seconds"], [[r.name, f"{r.seconds:.1f}"] for r in meta.stages])
'''),
    md('''
## Accuracy, stage by stage

Folding keeps the ANN's accuracy exactly. The QCFS-ANN is the folded ANN with each ReLU
quantised to L = T levels; without QCFS training `convert()` calibrates the spiking network
against the QCFS-ANN at 2T levels instead, so the SNN at T or 2T steps can beat this row. The
network is calibrated for T steps (and up to 2T): far beyond them its errors add up again and
the accuracy can fall.
'''),
    code('''
acc = meta.accuracy
print(f"test accuracy on {len(test_set)} images")
print_table(["network", "accuracy (%)"],
            [["ANN", f"{acc['ann']:.2f}"], ["ANN, BatchNorm folded", f"{acc['folded']:.2f}"],
             [f"QCFS-ANN (L={s['L']})", f"{acc['qcfs']:.2f}"]]
            + [[f"SNN, T={t}", f"{a:.2f}"] for t, a in acc["snn"].items()])
snnconv.assert_no_batchnorm(snn)
'''),
    md('''
## Thresholds

Each IF neuron fires when its membrane reaches its threshold theta (the calibrated QCFS lambda).
`convert()` gives every channel its own (the default with reset by subtraction): each box below
shows the thresholds of one layer's channels. They vary by an order of magnitude between layers
and within a layer, which is why one global threshold (or none) converts badly.
'''),
    code('''
thetas = {name: th.flatten().tolist() for name, th in snn.thresholds().items()}
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.boxplot(list(thetas.values()), whis=(0, 100))
ax.set_xticks(range(1, len(thetas) + 1)); ax.set_xticklabels(list(thetas), rotation=70, fontsize=7)
ax.set_ylabel("threshold theta (activation units)"); ax.set_title("thresholds per channel, by IF layer")
ax.grid(alpha=0.3)
plt.show()
'''),
    md('''
## One threshold per layer instead

`per_channel=False` is the one setting that differs in this second call; everything else is as
above. One threshold per layer is what consumers of plain NIR `IF` nodes expect (and the
default for `reset="zero"`); the table shows what it costs at each T.
'''),
    code('''
acc_pl = None
if compare_per_layer:
    _, meta_pl = snnconv.convert(model, train_loader, T=T, finetune_epochs=0, per_channel=False,
                                 reconstruction_steps=reconstruction_steps, eval_loader=test_loader,
                                 eval_T=eval_T, seed=seed, device=device)
    acc_pl = meta_pl.accuracy
    print(f"test accuracy (%) on {len(test_set)} images, T={T} conversion, no fine-tuning")
    print_table(["", "per channel (default)", "per layer"],
                [[f"QCFS-ANN (L={s['L']})", f"{acc['qcfs']:.2f}", f"{acc_pl['qcfs']:.2f}"]]
                + [[f"SNN, T={t}", f"{acc['snn'][t]:.2f}", f"{acc_pl['snn'][t]:.2f}"] for t in acc["snn"]])
'''),
    md('''
## Accuracy against time steps

What to look at: how far the curves stay below the ANN's dashed line at the T the network was
converted for, and what one threshold per layer costs. Fewer steps mean less latency and fewer
spikes; notebook 03 fine-tunes the network to do better at small T.
'''),
    code('''
Ts = sorted(int(t) for t in acc["snn"])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(Ts, [acc["snn"][str(t)] for t in Ts], marker="o", label="SNN, per channel (default)")
if acc_pl:
    ax.plot(Ts, [acc_pl["snn"][str(t)] for t in Ts], marker="s", label="SNN, per layer")
ax.axhline(acc["ann"], ls="--", color="C2", label="ANN")
ax.axhline(acc["qcfs"], ls="--", color="C3", label=f"QCFS-ANN (L={s['L']})")
ax.set_xscale("log", base=2); ax.set_xticks(Ts); ax.set_xticklabels(Ts); ax.minorticks_off()
ax.set_xlabel("time steps T"); ax.set_ylabel(f"test accuracy (%), {len(test_set)} images")
ax.grid(alpha=0.3); ax.legend()
plt.show()

snn.to("cpu").save(os.path.join(out_dir, "snn.pt"))
meta.to_json(os.path.join(out_dir, "meta.json"))
print(f"wrote {out_dir}/snn.pt and meta.json (the per-channel network)")
'''),
]

# --- 03 -----------------------------------------------------------------------------------------

NB03 = [
    intro("03", '''
# 03 Fine-tune the spiking network with BPTT

At a few time steps the converted network loses accuracy: a neuron has too few steps to express
its analog value. Backpropagation through time (BPTT) trains the spiking network itself,
through its time steps, with a smooth surrogate for the spike's derivative (spikingjelly's
ATan). `convert()` does this by default at T <= 8 when the loader has labels; notebook 02 turned
it off. Here `convert()` runs with all its defaults, and its network is compared with notebook
02's. The last section runs the same fine-tuning on its own with `snnconv.finetune`.
'''),
    run_params('''
T = 4                      # time steps the network is converted and fine-tuned for
eval_T = [1, 2, 4, 8, 16]
finetune_epochs = None     # None: the default of convert() (whole epochs until at least 512 steps)
extra_epochs = 0           # > 0: fine-tune that many epochs more with snnconv.finetune (last section)
batch_size = 128
''', num_workers=4),
    code('''
if dataset == "smoke":
    eval_T, finetune_epochs, extra_epochs, batch_size, num_workers = [1, 2, 4, 8], 1, 1, 32, 0
AUGMENT = True   # crop and flip for CIFAR-10 (the calibration sees them too)
'''),
    code(SETUP),
    code(DATA),
    md('''
## The ANN of notebook 01, the SNN of notebook 02

The ANN is converted again here, and it is the teacher of the fine-tuning (distillation).
Notebook 02's accuracies are the "before" of this notebook.
'''),
    code(LOAD_ANN + '''
require("02_convert", "meta.json")
with open(os.path.join(out_dir, "meta.json")) as fh:
    before = {int(t): a for t, a in json.load(fh)["accuracy"]["snn"].items()}
'''),
    md('''
## convert() with its defaults

The same call as in notebook 02 without `finetune_epochs=0` (`finetune_epochs=None` is the
default; the smoke setting shortens it to one epoch). The recipe it fine-tunes with
(`snnconv.pipeline.finetune_recipe`) unrolls **2T** steps and trains the readouts at T/2, T and
2T, so that the network answers well from half its steps to twice them; it distils from the ANN
(half the loss), trains the thresholds too, and keeps the converted network where no epoch beats
it on the validation split (10% of the training images; the test split only reports).
'''),
    code('''
t0 = time.perf_counter()
tuned, meta = snnconv.convert(model, train_loader, T=T, finetune_epochs=finetune_epochs,
                              eval_loader=test_loader, eval_T=eval_T, seed=seed, device=device)
print(f"converted and fine-tuned in {time.perf_counter() - t0:.0f} s")
s, ft, budget = meta.settings, meta.settings["finetune"], meta.settings["budget"]
print(f"fine-tuning: {s.get('finetune_default', 'finetune_epochs given')}")
print_table(["convert()'s fine-tuning", ""], [
    ["time steps unrolled", ft["T"]],
    ["readouts trained at T =", ", ".join(map(str, ft["horizons"]))],
    ["epochs", ft["epochs"]],
    ["batch size", ft["batch_size"]],
    ["optimiser steps planned", budget.get("finetune_steps")],
    ["optimiser", f"{ft['optimizer']}, lr {ft['lr']:g}, ATan alpha {ft['alpha']:g}"],
    ["distillation from the ANN", f"{ft['distill']:.0%} of the loss"],
    ["thresholds trained", ft["train_thresholds"]],
    ["optimiser steps run", budget.get("finetune_steps_run")],
    ["seconds", f"{budget.get('finetune_seconds', 0.0):.0f}"]])
'''),
    md('''
## What to look at

The training loss should fall and the validation accuracy (the mean over the trained readouts)
rise. Then compare the accuracy by T before and after: the gain is largest at and below the T
the network was converted for; at long T the fine-tuned network should stay close to the
converted one.
'''),
    code('''
history = next(r.changes["history"] for r in meta.stages if r.name == "finetune")
print_table(["epoch", "steps", "loss", "train accuracy (%)", "validation accuracy (%)", "seconds"],
            [[h["epoch"], h["steps"], f"{h['loss']:.3f}", f"{h['train_acc']:.2f}",
              f"{h['val_acc']:.2f}" if "val_acc" in h else "-", f"{h['seconds']:.0f}"] for h in history])
if history[-1].get("kept_start"):
    print("no epoch beat the converted network on the validation split: convert() kept it")
'''),
    md('''
## The same fine-tuning on its own

`snnconv.finetune` is the stage `convert()` ran, and `finetune_recipe(T, loader, ...)` its
settings: call them yourself to fine-tune longer, to resume an interrupted run
(`checkpoint_dir=...`, then `resume=True`), or on several GPUs under `torchrun`
(`snnconv finetune RUN_DIR` from the command line). The check below rebuilds the recipe and
compares it with the one `convert()` recorded; with `extra_epochs > 0` it then trains that many
epochs more, with a checkpoint in `out_dir/finetune`.
'''),
    code('''
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.pipeline import finetune_recipe

recipe = finetune_recipe(T, train_loader, epochs=ft["epochs"], seed=seed)
print("finetune_recipe(T, train_loader) is the recipe convert() used:", vars(recipe) == ft)
after = {int(t): a for t, a in meta.accuracy["snn"].items()}
if extra_epochs:
    recipe = finetune_recipe(T, train_loader, epochs=extra_epochs, seed=seed,
                             checkpoint_dir=os.path.join(out_dir, "finetune"))
    tuned, more = snnconv.finetune(tuned, train_loader, config=recipe, teacher=model, device=device)
    history = history + [dict(h, epoch=len(history) + h["epoch"]) for h in more]
    after = accuracy_by_T(tuned.to(device), test_loader, eval_T, device)
    print(f"{extra_epochs} epoch(s) more: validation accuracy {more[-1].get('val_acc', float('nan')):.2f}%")
'''),
    code('''
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
a1.plot([h["epoch"] for h in history], [h["loss"] for h in history], marker="o")
a1.set_xlabel("epoch"); a1.set_ylabel("training loss"); a1.grid(alpha=0.3)
Ts = sorted(after)
a2.plot([t for t in Ts if t in before], [before[t] for t in Ts if t in before], marker="o",
        label="converted (notebook 02)")
a2.plot(Ts, [after[t] for t in Ts], marker="s", label=f"fine-tuned for T={T}")
a2.axhline(meta.accuracy["ann"], ls="--", color="C2", label="ANN")
a2.set_xscale("log", base=2); a2.set_xticks(Ts); a2.set_xticklabels(Ts); a2.minorticks_off()
a2.set_xlabel("time steps T"); a2.set_ylabel(f"test accuracy (%), {len(test_set)} images")
a2.grid(alpha=0.3); a2.legend()
plt.show()
print(f"test accuracy (%) on {len(test_set)} images; ANN {meta.accuracy['ann']:.2f}")
print_table(["T", "converted (02)", "fine-tuned", "change"],
            [[t, f"{before[t]:.2f}" if t in before else "-", f"{after[t]:.2f}",
              f"{after[t] - before[t]:+.2f}" if t in before else "-"] for t in Ts])

tuned.to("cpu").save(os.path.join(out_dir, "snn_finetuned.pt"))
with open(os.path.join(out_dir, "finetune.json"), "w") as fh:
    json.dump({"T": T, "epochs": len(history), "config": {k: v for k, v in ft.items() if k != "checkpoint_dir"},
               "budget": budget, "history": history,
               "accuracy": {"snn": {str(t): a for t, a in after.items()},
                            "before": {str(t): a for t, a in before.items()}}}, fh, indent=2)
print(f"wrote {out_dir}/snn_finetuned.pt and finetune.json")
'''),
]
