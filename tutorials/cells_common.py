"""Cells and cell builders every tutorial notebook shares (see build_notebooks.py)."""

from __future__ import annotations

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
            raise MissingInput(f"run {notebook} first: {path} is missing")'''

DATA = '''\
from torch.utils.data import DataLoader, Subset

if dataset == "smoke":      # CIFAR-shaped images made here: 3x32x32, 10 classes, learnable
    train_set, test_set = sdata.synthetic(n_train=512, n_test=128, seed=seed)
elif dataset == "fashion_mnist":
    train_set, test_set = sdata.load("fashion_mnist")
elif dataset == "cifar10":
    train_set, test_set = sdata.load("cifar10", root=data_root, download=True, augment=AUGMENT)
else:
    raise ValueError(f"dataset must be 'smoke', 'fashion_mnist' or 'cifar10', not {dataset!r}")
if train_limit:
    train_set = Subset(train_set, range(min(train_limit, len(train_set))))
if test_limit:
    test_set = Subset(test_set, range(min(test_limit, len(test_set))))
in_channels = train_set[0][0].shape[0]
train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(seed), drop_last=True)
test_loader = DataLoader(test_set, batch_size=256, num_workers=num_workers)
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
train_limit = None
test_limit = None
num_workers = {num_workers}
device = "auto"
seed = 0
''')
