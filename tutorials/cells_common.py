"""Cells and cell builders every tutorial notebook shares (see build_notebooks.py)."""

from __future__ import annotations

#: Each notebook's wall time in seconds with ``dataset="smoke"`` and in the Fashion-MNIST run
#: below (one kernel each, one thread, on 2 CPU cores shared with other work), as its first cell
#: says; tests/test_tutorials.py runs both.
SMOKE_SECONDS = {"01": 20, "02": 37, "03": 60, "04": 11, "05": 15}
FASHION_SECONDS = {"01": 174, "02": 570, "03": 1063, "04": 244, "05": 30}

#: The test accuracies (%) of that run (seed 0): the ANN, and the SNN at T=4 after notebook 03.
FASHION_ACCURACY = {"ann": 87.45, "snn": 85.45}

# the shell commands of the real-data runs, quoted by every first cell
FASHION_COMMAND = '''\
mkdir -p runs/fmnist
P="-p dataset fashion_mnist -p out_dir runs/fmnist -p train_limit 10000 -p test_limit 2000"
papermill tutorials/01_train_resnet18_cifar10.ipynb runs/fmnist/01.ipynb $P \\
  -p model_name resnet8 -p epochs 5 -p batch_size 64 -p lr 0.05
for nb in 02_convert 03_finetune_bptt 04_nir_and_backends 05_analysis; do
  papermill tutorials/$nb.ipynb runs/fmnist/$nb.ipynb $P
done'''

CIFAR_COMMAND = '''\
mkdir -p runs/cifar10
for nb in 01_train_resnet18_cifar10 02_convert 03_finetune_bptt 04_nir_and_backends 05_analysis; do
  papermill tutorials/$nb.ipynb runs/cifar10/$nb.ipynb -p dataset cifar10 -p out_dir runs/cifar10
done'''


def _duration(seconds: float) -> str:
    return f"about {seconds:.0f} s" if seconds < 100 else f"about {seconds / 60:.0f} minutes"


def intro(number: str, text: str) -> dict:
    """The first cell of notebook ``number``: its own ``text``, then what the three data
    settings show and how to run them."""
    smoke, real = SMOKE_SECONDS[number], FASHION_SECONDS[number]
    total = sum(FASHION_SECONDS.values())
    return md(text.strip("\n") + f'''

**Three ways to run it** (`dataset` in the parameters cell below):

- `"smoke"`, what CI runs ({_duration(smoke)} for this notebook on 2 CPU cores): ResNet-8 on
  made-up CIFAR-shaped images, a few batches, short training runs. It shows that the code runs and
  hands its files to the next notebook; it does **not** show what conversion does (the made-up
  classes are easy, so its accuracies say little).
- `"fashion_mnist"`, real images offline: Debian's `dataset-fashion-mnist`
  (`sudo apt-get install dataset-fashion-mnist`), padded to 3x32x32, ResNet-8 trained for 5
  epochs on 10,000 images, the first 2,000 test images. On 2 CPU cores this notebook took
  {_duration(real)}, all five {_duration(total)}; the ANN reached {FASHION_ACCURACY["ann"]:.2f}%
  and the SNN at T=4 {FASHION_ACCURACY["snn"]:.2f}% after notebook 03's fine-tuning.
- `"cifar10"`, the real thing: torchvision downloads CIFAR-10 (170 MB) and notebook 01 trains
  a ResNet-18 for 200 epochs, which is meant for a GPU (about an hour on a recent one).

The notebooks hand files to each other through `out_dir`; run them in order, for example with
papermill (`pip install papermill`):

```sh
{FASHION_COMMAND}
```

and for CIFAR-10 on a GPU:

```sh
{CIFAR_COMMAND}
```
''')


# --- cells shared by every notebook -------------------------------------------------------------

SETUP = '''\
import os, json, time, warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a kernel without widgets
import torch
import matplotlib.pyplot as plt
import snnconv
from snnconv import data as sdata, models

if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed)
print(f"snnconv {snnconv.__version__}, torch {torch.__version__}, device {device}, dataset {dataset}")
print(f"files go to {os.path.abspath(out_dir)}")


class MissingInput(FileNotFoundError):
    """A file that an earlier notebook writes is missing: shown as one line, not a traceback."""

    def _render_traceback_(self):  # IPython prints this instead of the traceback
        return [str(self)]


def require(notebook, *names):
    """Stop with one line when a file that ``notebook`` writes into out_dir is missing."""
    for name in names:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            raise MissingInput(f"run {notebook} first: {path} is missing")


def print_table(header, rows):
    """Rows as aligned columns: the first left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def si(value, unit):
    """A quantity with an SI prefix and three significant digits: si(1.76e-4, "J") -> '176 µJ'."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"),
                           (1e-6, "µ"), (1e-9, "n"), (1e-12, "p")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"'''

DATA = '''\
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset


def cifar_shaped(images, limit):
    """Fashion-MNIST's 1x28x28 images as 3x32x32: padded with the background, grey in 3 channels."""
    x, y = images.tensors[0][:limit], images.tensors[1][:limit]
    x = F.pad(x, (2, 2, 2, 2), value=float(x.min()))  # the smallest value is the background
    return TensorDataset(x.expand(-1, 3, -1, -1), y)  # a view: no copy per channel


if dataset == "smoke":      # CIFAR-shaped images made here: 3x32x32, 10 classes, learnable
    train_set, test_set = sdata.synthetic(n_train=512, n_test=128, seed=seed)
elif dataset == "fashion_mnist":
    train_set, test_set = (cifar_shaped(s, n) for s, n in zip(sdata.load("fashion_mnist"),
                                                               (train_limit, test_limit)))
elif dataset == "cifar10":
    train_set, test_set = sdata.load("cifar10", root=data_root, download=True, augment=AUGMENT)
else:
    raise ValueError(f"dataset must be 'smoke', 'fashion_mnist' or 'cifar10', not {dataset!r}")
if train_limit:
    train_set = Subset(train_set, range(min(train_limit, len(train_set))))
if test_limit:
    test_set = Subset(test_set, range(min(test_limit, len(test_set))))
in_channels = train_set[0][0].shape[0]
workers = num_workers if dataset == "cifar10" else 0  # the other data sets are tensors in memory
train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(seed), drop_last=True)
test_loader = DataLoader(test_set, batch_size=256, num_workers=workers)
print(f"{dataset}: {len(train_set)} training / {len(test_set)} test images of shape "
      f"{tuple(train_set[0][0].shape)}")'''


def md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text.strip("\n")}


def code(text: str, tags: list[str] | None = None) -> dict:
    meta = {"tags": tags} if tags else {}
    return {"cell_type": "code", "execution_count": None, "metadata": meta, "outputs": [],
            "source": text.strip("\n")}


def params(text: str) -> dict:
    return code(text, tags=["parameters"])


def run_params(own: str, *, num_workers: int) -> dict:
    """The parameters cell of notebooks 02 on: the dataset and folders, ``own`` lines, the data loading."""
    return params(f'''
dataset = "cifar10"        # "smoke" | "fashion_mnist" | "cifar10"
out_dir = "runs/tutorial"
data_root = "data/cifar10"
{own.strip()}
train_limit = None         # use only the first N training images
test_limit = None
num_workers = {num_workers}            # loader processes for CIFAR-10 (the others are in memory)
device = "auto"            # "auto": cuda when available
seed = 0
''')
