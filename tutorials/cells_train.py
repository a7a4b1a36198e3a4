"""Notebooks 01-03: train the ResNet-18, convert it, fine-tune it (see build_notebooks.py)."""

from __future__ import annotations

from cells_common import DATA, SETUP, code, md, params, run_params


# --- 01 -----------------------------------------------------------------------------------------

NB01 = [
    md('''
# 01 Train a ResNet-18 on CIFAR-10

The network we will convert into a spiking network: a CIFAR-style ResNet-18 (3x3 stem, no
max-pooling, four stages of two BasicBlocks, 64 to 512 channels, **BatchNorm after every
convolution**, ReLU). snnconv does not need you to train it in any special way: a standard
recipe, standard BatchNorm, plain ReLU.

**The recipe** (the usual one for this network): SGD with Nesterov momentum 0.9, learning rate
0.1, weight decay 5e-4, batch 128, a cosine schedule over 200 epochs, random crop (padding 4)
and horizontal flip. On one GPU it reaches about **95% test accuracy** (94.5-95.5% across seeds
in the literature for this architecture and schedule; we have not measured a full run in this
repository's CI). With bfloat16 autocast expect roughly 10-20 s per epoch on a recent data-centre
GPU, so about an hour in all. Fewer epochs trade accuracy for time: 30 epochs land near 93%.

Parameters (papermill): `dataset="smoke"` runs the same code on CIFAR-shaped data made on the
spot for one short epoch with ResNet-8 (what CI runs, seconds on a CPU); `"fashion_mnist"` uses
real data available offline; `"cifar10"` is the real thing.
'''),
    params('''
dataset = "cifar10"        # "smoke" | "fashion_mnist" | "cifar10"
out_dir = "runs/tutorial"  # every notebook reads and writes its files here
data_root = "data/cifar10"
model_name = "resnet18"
epochs = 200
batch_size = 128
lr = 0.1
weight_decay = 5e-4
train_limit = None         # use only the first N training images
test_limit = None
num_workers = 4
device = "auto"            # "auto": cuda when available
seed = 0
'''),
    md('''
The smoke setting shrinks everything so that the notebook runs in seconds; the code path is the
same (ResNet-8 is the same `CifarResNet` class with one block per stage).
'''),
    code('''
if dataset == "smoke":
    model_name, epochs, batch_size, num_workers = "resnet8", 4, 32, 0  # seconds; well above chance
AUGMENT = True   # random crop + flip for CIFAR-10's training split
'''),
    code(SETUP),
    md('''
## Data

CIFAR-10 comes through torchvision (normalised with the usual channel means and deviations,
augmented with crop and flip for training). Check the counts: 50000 / 10000 for CIFAR-10,
60000 / 10000 for Fashion-MNIST.
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

A plain loop so that you can see every choice: SGD + Nesterov, cosine decay of the learning
rate per step, bfloat16 autocast on a GPU. The checkpoint (`ann.pt`, a state dict) is written
atomically after every epoch, so an interrupted run leaves a usable file.
'''),
    code('''
import torch.nn.functional as F
from snnconv.meta import atomic_write_bytes
from snnconv.metrics import evaluate
import io

opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
steps = epochs * len(train_loader)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15,
                                            anneal_strategy="cos")
use_amp = device.startswith("cuda")
history = []

def save_state(model, path):
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    atomic_write_bytes(path, buf.getvalue())

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
    test_acc = evaluate(model, test_loader, device) if (epoch + 1) % 5 == 0 or epoch + 1 == epochs else None
    history.append({"epoch": epoch + 1, "loss": loss_sum / total, "train_acc": 100 * correct / total,
                    "test_acc": test_acc, "seconds": time.perf_counter() - t0})
    save_state(model, os.path.join(out_dir, "ann.pt"))
    print(f"epoch {epoch + 1}/{epochs}: loss {loss_sum / total:.3f}, train {100 * correct / total:.1f}%"
          + (f", test {test_acc:.2f}%" if test_acc is not None else "")
          + f" ({history[-1]['seconds']:.0f} s)")
'''),
    md('''
## What to look at

The training loss should fall steadily and the test accuracy (every 5 epochs) rise to about 95%
at the end of the cosine schedule for CIFAR-10. A test accuracy far below the training accuracy
means overfitting (check that augmentation is on); a loss that does not move means a wrong
learning rate or unnormalised inputs.
'''),
    code('''
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([h["epoch"] for h in history], [h["train_acc"] for h in history], label="train")
pts = [(h["epoch"], h["test_acc"]) for h in history if h["test_acc"] is not None]
ax.plot(*zip(*pts), marker="o", label="test")
ax.set_xlabel("epoch"); ax.set_ylabel("accuracy (%)"); ax.grid(alpha=0.3); ax.legend()
ax.set_title(f"{model_name} on {dataset}")
plt.show()

ann_accuracy = evaluate(model, test_loader, device)
with open(os.path.join(out_dir, "ann.json"), "w") as fh:
    json.dump({"model": model_name, "dataset": dataset, "in_channels": in_channels,
               "test_accuracy": ann_accuracy, "history": history}, fh, indent=2)
print(f"ANN test accuracy {ann_accuracy:.2f}%; wrote {out_dir}/ann.pt and ann.json")
'''),
]

# --- 02 -----------------------------------------------------------------------------------------

NB02 = [
    md('''
# 02 Convert the ANN into a spiking network

`snnconv.convert` runs the whole strict pipeline on a copy of the trained network:
**fold BatchNorm -> QCFS calibration -> IF neurons** (-> optional fine-tuning, notebook 03),
with a no-BatchNorm guard between every two stages. This notebook runs the steps one at a time
first, so that you can see what each guarantees, then the pipeline in one call.
'''),
    run_params('''
L = 8                      # QCFS quantisation levels: the SNN is exact for T >= L in the limit
T = 8                      # time steps of the converted network
eval_T = [1, 2, 4, 8, 16, 32]
qcfs_epochs = 0            # QCFS-aware ANN training epochs (1-2 help at small T)
per_channel = False        # per-channel thresholds
batch_size = 128
''', num_workers=4),
    code('''
if dataset == "smoke":
    eval_T, batch_size, num_workers = [1, 2, 4], 32, 0
    T = min(T, 4)
AUGMENT = False  # calibration sees the training images as they are
'''),
    code(SETUP),
    code(DATA),
    md('''
## Load the checkpoint of notebook 01

`ann.pt` is a plain state dict, read with `torch.load(..., weights_only=True)`: loading it never
runs code from the file.
'''),
    code('''
require("01_train_resnet18_cifar10", "ann.json", "ann.pt")
with open(os.path.join(out_dir, "ann.json")) as fh:
    ann_info = json.load(fh)
model = models.get(ann_info["model"], num_classes=10, in_channels=ann_info["in_channels"])
model.load_state_dict(torch.load(os.path.join(out_dir, "ann.pt"), map_location="cpu", weights_only=True))
model.eval()
print(f"loaded {ann_info['model']} ({ann_info['test_accuracy']:.2f}% on the test set)")
'''),
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
rounding level (around 1e-6 or below), and the folded network's accuracy identical to the ANN's.
'''),
    code('''
from snnconv.metrics import evaluate

x_check = next(iter(test_loader))[0][:16]
folded = snnconv.fold_batchnorm(model, x_check)
snnconv.assert_no_batchnorm(folded)          # passes now
diffs = [p["max_abs_diff"] for p in folded.meta["folded"]]
print(f"{len(diffs)} pairs folded; largest difference per pair: {max(diffs):.2e}")
with torch.no_grad():
    print(f"whole-network max |ANN - folded| on a batch: {(model(x_check) - folded(x_check)).abs().max():.2e}")
'''),
    md('''
## The whole pipeline in one call

`convert` repeats fold (on its own copy), calibrates one QCFS threshold per ReLU call site from
the training data, replaces each by an IF neuron with reset by subtraction, and evaluates on the
test set at every T in `eval_T` (the test set is never used to choose anything). By default it
also fine-tunes where T <= 8 (whole epochs, at least 512 steps); `finetune_epochs=0` here keeps
this notebook to the stages without BPTT, and notebook 03 fine-tunes step by step. At T <= 8
those include 300 SGD steps that fit each IF layer to the QCFS-ANN on the calibration images
(no labels read; `reconstruction_steps=0` skips them).
'''),
    code('''
t0 = time.perf_counter()
snn, meta = snnconv.convert(model, train_loader, T=T, L=L, per_channel=per_channel,
                            qcfs_epochs=qcfs_epochs, finetune_epochs=0, eval_loader=test_loader,
                            eval_T=eval_T, seed=seed, device=device, progress=False)
acc = meta.accuracy
print(f"converted in {time.perf_counter() - t0:.0f} s")
print(f"ANN {acc['ann']:.2f}%, folded {acc['folded']:.2f}%, QCFS-ANN (L={L}) {acc['qcfs']:.2f}%")
for t, a in acc["snn"].items():
    print(f"SNN T={t:>3}: {a:.2f}%")
snnconv.assert_no_batchnorm(snn)
'''),
    md('''
## Thresholds per layer

Each IF layer fires when its membrane reaches its threshold theta (the calibrated QCFS lambda).
Thresholds usually vary by an order of magnitude between layers: this is why one global
threshold (or none) converts badly.
'''),
    code('''
thetas = {name: th.flatten().tolist() for name, th in snn.thresholds().items()}
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.boxplot(list(thetas.values()), whis=(0, 100))
ax.set_xticks(range(1, len(thetas) + 1)); ax.set_xticklabels(list(thetas), rotation=70, fontsize=7)
ax.set_ylabel("threshold theta"); ax.set_title("thresholds per IF layer"); ax.grid(alpha=0.3)
plt.show()
'''),
    md('''
## Accuracy against time steps

The spiking network's accuracy climbs with T towards the QCFS-ANN's. What to look at: the T at
which the curve comes within a point of the dashed lines. Fewer steps mean less latency and
fewer spikes; notebook 03 fine-tunes the network to do better at small T.
'''),
    code('''
Ts = sorted(int(t) for t in acc["snn"])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(Ts, [acc["snn"][str(t)] for t in Ts], marker="o", label="SNN")
ax.axhline(acc["ann"], ls="--", color="C2", label="ANN")
ax.axhline(acc["qcfs"], ls="--", color="C3", label=f"QCFS-ANN (L={L})")
ax.set_xscale("log", base=2); ax.set_xticks(Ts); ax.set_xticklabels(Ts); ax.minorticks_off()
ax.set_xlabel("time steps T"); ax.set_ylabel("accuracy (%)"); ax.grid(alpha=0.3); ax.legend()
plt.show()

snn.to("cpu").save(os.path.join(out_dir, "snn.pt"))
meta.to_json(os.path.join(out_dir, "meta.json"))
print(f"wrote {out_dir}/snn.pt and meta.json")
'''),
]

# --- 03 -----------------------------------------------------------------------------------------

NB03 = [
    md('''
# 03 Fine-tune the spiking network with BPTT

At a few time steps the converted network loses accuracy: a neuron has too few steps to express
its analog value. Backpropagation through time (BPTT) trains the spiking network itself, through
the T steps, with a smooth surrogate for the spike's derivative (spikingjelly's ATan).

The recipe measured on Fashion-MNIST (README, benchmarks): AdamW, lr 2e-3, ATan alpha 4, loss on
the T=4 readout, trainable thresholds, distillation from the ANN (0.5). Validation data is split
from the training data; the test split only reports.
'''),
    run_params('''
T = 4                      # steps unrolled in training
eval_T = [1, 2, 4, 8, 16]
epochs = 2
lr = 2e-3
alpha = 4.0
distill = 0.5
max_steps_per_epoch = None
batch_size = 64
''', num_workers=4),
    code('''
if dataset == "smoke":
    T, eval_T, epochs, max_steps_per_epoch, batch_size, num_workers = 2, [1, 2, 4], 1, 3, 32, 0
AUGMENT = True
'''),
    code(SETUP),
    code(DATA),
    md('''
## Start from notebook 02's network

`SpikingNetwork.load` rebuilds the graph from plain data (no pickled code). The ANN is loaded too,
as the teacher for distillation.
'''),
    code('''
from snnconv.metrics import accuracy_by_T

require("01_train_resnet18_cifar10", "ann.json", "ann.pt")
require("02_convert", "snn.pt")
snn = snnconv.SpikingNetwork.load(os.path.join(out_dir, "snn.pt"))
with open(os.path.join(out_dir, "ann.json")) as fh:
    ann_info = json.load(fh)
ann = models.get(ann_info["model"], num_classes=10, in_channels=ann_info["in_channels"])
ann.load_state_dict(torch.load(os.path.join(out_dir, "ann.pt"), map_location="cpu", weights_only=True))
before = accuracy_by_T(snn.to(device), test_loader, eval_T, device)
print("before fine-tuning:", {t: round(a, 2) for t, a in before.items()})
'''),
    md('''
## BPTT

`snnconv.finetune` works on a copy and returns the best epoch on the validation split. The
checkpoint folder makes the run resumable (`resume=True` after an interruption continues
bit-identically on CPU).
'''),
    code('''
t0 = time.perf_counter()
tuned, history = snnconv.finetune(
    snn, train_loader, T=T, epochs=epochs, lr=lr, alpha=alpha, train_thresholds=True,
    distill=distill, teacher=ann, max_steps_per_epoch=max_steps_per_epoch,
    checkpoint_dir=os.path.join(out_dir, "finetune"), seed=seed, device=device, progress=False)
print(f"fine-tuned in {time.perf_counter() - t0:.0f} s")
for h in history:
    print(h)
'''),
    md('''
## What to look at

The training loss should fall and the validation accuracy rise. Then compare the accuracy by T
before and after: the gain is largest at and below the T used in training; at long T the
fine-tuned network should stay close to the converted one (the recipe above was chosen so that
it does).
'''),
    code('''
after = accuracy_by_T(tuned.to(device), test_loader, eval_T, device)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
a1.plot([h["epoch"] for h in history], [h["loss"] for h in history], marker="o")
a1.set_xlabel("epoch"); a1.set_ylabel("training loss"); a1.grid(alpha=0.3)
a2.plot(eval_T, [before[t] for t in eval_T], marker="o", label="converted")
a2.plot(eval_T, [after[t] for t in eval_T], marker="s", label=f"fine-tuned at T={T}")
a2.set_xscale("log", base=2); a2.set_xticks(eval_T); a2.set_xticklabels(eval_T); a2.minorticks_off()
a2.set_xlabel("time steps T"); a2.set_ylabel("test accuracy (%)"); a2.grid(alpha=0.3); a2.legend()
plt.show()
for t in eval_T:
    print(f"T={t:>3}: {before[t]:6.2f}% -> {after[t]:6.2f}%")

tuned.to("cpu").save(os.path.join(out_dir, "snn_finetuned.pt"))
with open(os.path.join(out_dir, "finetune.json"), "w") as fh:
    json.dump({"T": T, "epochs": epochs, "lr": lr, "alpha": alpha, "distill": distill,
               "history": history, "accuracy": {"snn": {str(t): a for t, a in after.items()},
                                                "before": {str(t): a for t, a in before.items()}}},
              fh, indent=2)
print(f"wrote {out_dir}/snn_finetuned.pt and finetune.json")
'''),
]
