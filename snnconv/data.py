"""Datasets and loader helpers.

- scikit-learn digits (1797 8x8 images, ships with scikit-learn): the embedded default;
- Fashion-MNIST from the IDX files of Debian's ``dataset-fashion-mnist`` package, or through
  torchvision's download where a network exists;
- CIFAR-10 through torchvision (``torchvision.datasets.CIFAR10``);
- a folder of the user's images in torchvision's ``ImageFolder`` layout (:func:`image_folder`).
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import warnings
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from snnconv.errors import ConfigError, DataError

__all__ = ["SameShape",
    "digits",
    "fashion_mnist",
    "cifar10",
    "read_idx",
    "split_batch",
    "split_loader",
    "split_dataset",
    "first_batch",
    "calibration_batches",
    "DEBIAN_FASHION_MNIST",
    "FASHION_MEAN",
    "FASHION_STD",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "synthetic",
    "load",
    "image_folder",
    "labels_of",
    "stratified_subset",
    "DATASETS",
    "TEST_EVERY",
]

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
#: Fashion-MNIST's normalisation: the training split's pixel mean and std (pixels in [0, 1]).
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
#: CIFAR-10's normalisation: per channel (R, G, B) means and stds (pixels in [0, 1]).
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def digits(*, test_fraction: float = 0.25, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as ``(train, test)`` TensorDatasets of ``[1, 8, 8]`` float images.

    Pixels are scaled to [0, 1] and standardised with the training split's mean and std; the
    split is stratified-free but seeded and fixed.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(x) * test_fraction))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a numpy array, checking its header."""
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise DataError(f"IDX file not found: {path}") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read IDX file {path}: {exc}") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    dtypes: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = data[2], data[3]
    if code not in dtypes:
        raise DataError(f"{path}: unknown IDX element type 0x{code:02x}")
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(dtypes[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise DataError(f"{path}: header says shape {shape} ({expected} bytes) but the file holds "
                        f"{len(data) - header} bytes of data; the file is truncated or corrupted")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def _idx_file(root: str, stem: str) -> str | None:
    for name in (stem + ".gz", stem):
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
    return None


def fashion_mnist(root: str | None = None, *, train: bool = True, download: bool = False,
                  normalize: bool = True, download_hint: str = "call fashion_mnist(root=DIR, "
                  "download=True) where a network is available") -> TensorDataset:
    """Fashion-MNIST as a TensorDataset of ``[1, 28, 28]`` float images and labels.

    ``normalize`` (default): pixels in [0, 1] become ``(x - 0.2860) / 0.3530``
    (:data:`FASHION_MEAN`, :data:`FASHION_STD`: the training split's mean and std), from -0.81
    to 2.02; ``normalize=False`` keeps them in [0, 1].

    Looks in ``root`` (default: Debian's ``/usr/share/datasets/fashion-mnist``) for the four IDX
    files; with ``download=True`` and no files there, uses torchvision's downloader into ``root``.
    ``download_hint``: how the message for missing files says to download them.

    Raises:
        DataError: the files are missing (the message says how to get them) or corrupted.
    """
    root = root or os.environ.get("SNNCONV_FASHION_MNIST", DEBIAN_FASHION_MNIST)
    prefix = "train" if train else "t10k"
    images = _idx_file(root, f"{prefix}-images-idx3-ubyte")
    labels = _idx_file(root, f"{prefix}-labels-idx1-ubyte")
    if (images is None or labels is None) and download:
        from torchvision.datasets import FashionMNIST

        FashionMNIST(root, train=train, download=True)
        raw = os.path.join(root, "FashionMNIST", "raw")
        images = _idx_file(raw, f"{prefix}-images-idx3-ubyte")
        labels = _idx_file(raw, f"{prefix}-labels-idx1-ubyte")
    if images is None or labels is None:
        raise DataError(
            f"Fashion-MNIST {prefix} files not found in {root}. Install them with "
            f"'sudo apt-get install dataset-fashion-mnist' (Debian/Ubuntu), or {download_hint}, or "
            "point SNNCONV_FASHION_MNIST at a folder holding the IDX files.")
    x = torch.from_numpy(read_idx(images).copy()).float().div_(255.0).unsqueeze(1)
    y = torch.from_numpy(read_idx(labels).astype(np.int64))
    if x.dim() != 4 or x.shape[2:] != (28, 28) or len(x) != len(y):
        raise DataError(f"Fashion-MNIST files in {root} have unexpected shapes {tuple(x.shape)} "
                        f"and {tuple(y.shape)}")
    if normalize:
        x = (x - FASHION_MEAN) / FASHION_STD
    return TensorDataset(x, y)


def cifar10(root: str, *, train: bool = True, download: bool = False, augment: bool = False,
            download_hint: str = "Pass download=True where a network exists") -> Dataset:
    """CIFAR-10 through torchvision, normalised per channel with the usual statistics: means
    ``(0.4914, 0.4822, 0.4465)``, stds ``(0.2470, 0.2435, 0.2616)`` (:data:`CIFAR_MEAN`,
    :data:`CIFAR_STD`).
    ``download_hint``: how the message for missing files says to download them.

    Raises:
        DataError: the dataset is not in ``root`` and ``download`` is False.
    """
    import torchvision
    import torchvision.transforms as T

    steps: list[Any] = []
    if augment:
        steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    steps += [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    try:
        return torchvision.datasets.CIFAR10(root, train=train, download=download,
                                            transform=T.Compose(steps))
    except (RuntimeError, OSError) as exc:  # missing or corrupted files; a failed download
        raise DataError(
            f"CIFAR-10 not found in {root} ({exc}). {download_hint}, or "
            "copy the 'cifar-10-batches-py' folder from https://www.cs.toronto.edu/~kriz/ there."
        ) from exc


#: The most batches read from a loader without ``len()`` in one pass (an endless stream is
#: refused after this many rather than read until memory or time runs out): 1.28 million
#: images in batches of 128, more than any test set.
MAX_UNSIZED_BATCHES = 10_000


def _sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def bounded(loader: Iterable, *, where: str, limit: int | None = None) -> Iterator[Any]:
    """The batches of ``loader``; a loader without ``len()`` that yields more than ``limit``
    (default :data:`MAX_UNSIZED_BATCHES`) raises DataError instead of running forever."""
    if _sized(loader):
        yield from loader
        return
    limit = MAX_UNSIZED_BATCHES if limit is None else limit
    for i, batch in enumerate(loader):
        if i >= limit:
            raise DataError(f"{where} has no len() and yielded more than {limit} batches: an endless "
                            "stream? Pass a finite loader (a DataLoader over a sized dataset, or a "
                            "list of batches), or bound it (itertools.islice in a re-iterable).")
        yield batch


def check_labels(y: torch.Tensor, num_classes: int, *, where: str) -> None:
    """Refuse labels that are neither class indices in ``[0, num_classes)`` nor class
    probabilities of shape ``[B, num_classes]`` (what the model's outputs can be scored against)."""
    if y.dtype.is_floating_point and y.dim() == 2 and y.shape[1] == num_classes:
        return
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.dim() != 1:
        raise DataError(f"{where} yielded labels of dtype {y.dtype} and shape {tuple(y.shape)}; "
                        f"expected a 1-d tensor of class indices (or [B, {num_classes}] probabilities)")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{where} yielded labels from {int(y.min())} to {int(y.max())}, but the model "
                        f"has {num_classes} outputs (classes 0 to {num_classes - 1}); fix the labels "
                        "or the model's last layer")


def split_batch(batch: Any, *, where: str = "loader") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, y)``, ``[x, y]``, ``{"x"/"input", "y"/"label"}`` or a bare ``x`` -> ``(x, y or None)``;
    an empty batch raises DataError."""
    x, y = _split(batch, where)
    if not isinstance(x, torch.Tensor):
        raise DataError(f"{where} yielded inputs of type {type(x).__name__}, not a tensor")
    if x.dim() == 0 or x.shape[0] == 0:
        raise DataError(f"{where} yielded an empty batch (inputs of shape {tuple(x.shape)}); drop "
                        "empty batches (for example DataLoader(drop_last=True), or filter the list)")
    if y is not None and y.dim() > 0 and y.shape[0] != x.shape[0]:
        raise DataError(f"{where} yielded {x.shape[0]} inputs but {y.shape[0]} labels in one batch")
    return x, y


class SameShape:
    """Checks each batch of one pass against the first: inputs of one per-sample shape and dtype
    (a later batch that differs would otherwise fail deep inside torch, or silently broadcast)."""

    def __init__(self, where: str):
        self.where = where
        self.first: tuple[tuple[int, ...], torch.dtype] | None = None

    def __call__(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """``x``, or DataError naming batch ``index`` (counted from 0) and both shapes."""
        found = (tuple(x.shape[1:]), x.dtype)
        if self.first is None:
            self.first = found
        elif found != self.first:
            raise DataError(f"{self.where}: batch {index} holds inputs of shape {list(found[0])} "
                            f"({found[1]}) per sample, the first batch {list(self.first[0])} "
                            f"({self.first[1]}); every batch must hold inputs of one shape and dtype "
                            "(resize or pad them in the dataset's transform)")
        return x


def _split(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        x = next((batch[k] for k in ("x", "input", "inputs", "image", "images") if k in batch), None)
        y = next((batch[k] for k in ("y", "label", "labels", "target", "targets") if k in batch), None)
        if x is None:
            raise DataError(f"{where} yielded a dict with keys {sorted(batch)}; expected 'x' or 'input'")
        return x, y
    if isinstance(batch, (tuple, list)) and len(batch) >= 1 and isinstance(batch[0], torch.Tensor):
        y = batch[1] if len(batch) > 1 else None
        if y is not None and not isinstance(y, torch.Tensor):
            y = torch.as_tensor(y)
        return batch[0], y
    raise DataError(f"{where} yielded a {type(batch).__name__}; expected a tensor, (x, y) or [x, y]")


def first_batch(loader: Iterable, *, where: str = "loader") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``(x, y)`` of ``loader``; DataError when the loader is empty."""
    for batch in loader:
        return split_batch(batch, where=where)
    raise DataError(f"{where} is empty: it yielded no batch. Pass a loader with at least one batch.")


def calibration_batches(loader: Any, num_batches: int, where: str) -> list[torch.Tensor]:
    """The inputs of the first ``num_batches`` batches of ``loader`` (``where`` names it in errors).

    Raises:
        DataError: the loader is empty, or a batch is not an input (or an input and labels).
    """
    batches: list = []
    same = SameShape(f"the {where}")
    for batch in loader:
        if len(batches) >= num_batches:
            break
        batches.append(same(split_batch(batch, where=where)[0], len(batches)))
    if not batches:
        raise DataError(f"the {where} is empty: it yielded no batch")
    return batches


def _generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that order ``loader``'s batches (its own, its sampler's,
    its batch sampler's sampler's), each once."""
    found: dict[int, torch.Generator] = {}
    for obj in (loader, getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


@contextlib.contextmanager
def generators_kept(*loaders: Any) -> Iterator[None]:
    """Inside, iterate ``loaders`` freely; on leaving, the generators that shuffle them
    (``DataLoader(generator=...)``, a sampler's) are put back in the state they had on entry.
    A loader with its own generator would otherwise give the next call other batches, so that
    two identical calls differ."""
    saved = [(g, g.get_state()) for loader in loaders if loader is not None for g in _generators(loader)]
    try:
        yield
    finally:
        for g, state in saved:
            g.set_state(state)


class _BatchList:
    """A re-iterable list of batches (used when a loader cannot be split by dataset)."""

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self) -> Iterator:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def split_dataset(dataset: Dataset, val_fraction: float, *, seed: int = 0) -> tuple[Subset, Subset]:
    """A seeded random ``(train, validation)`` split of a sized dataset."""
    n = len(dataset)  # type: ignore[arg-type]  # a sized dataset (the callers check)
    n_val = max(1, int(round(n * val_fraction)))
    if n_val >= n:
        raise DataError(f"the training data holds {n} samples, too few to hold out {n_val} "
                        "for validation; lower val_fraction or pass more data")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(dataset, perm[n_val:]), Subset(dataset, perm[:n_val])


def split_loader(loader: Iterable, val_fraction: float, *, seed: int = 0) -> tuple[Iterable, Iterable | None]:
    """Split a training loader into ``(train, validation)``; never touches any test data.

    A ``DataLoader`` over a sized dataset is split by a seeded random permutation of sample
    indices (same batch size, workers and collate function). Any other iterable is split by
    batches: every ``round(1 / val_fraction)``-th batch goes to validation.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0:
        return loader, None
    if isinstance(loader, DataLoader) and hasattr(loader.dataset, "__len__"):
        train_set, val_set = split_dataset(loader.dataset, val_fraction, seed=seed)
        common: dict[str, Any] = dict(batch_size=loader.batch_size or 1, num_workers=loader.num_workers,
                                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory)
        train = DataLoader(train_set, shuffle=True,
                           generator=torch.Generator().manual_seed(seed + 1),
                           drop_last=loader.drop_last, **common)
        return train, DataLoader(val_set, shuffle=False, **common)
    batches = list(loader) if _sized(loader) else list(
        bounded(loader, where="the training loader"))
    if len(batches) < 2:
        raise DataError(f"the training loader yielded {len(batches)} batch(es); at least 2 are "
                        "needed to hold out a validation split. Pass val_fraction=0 or more data.")
    k = max(2, min(len(batches), int(round(1.0 / val_fraction))))
    return (_BatchList([b for i, b in enumerate(batches) if i % k != k - 1]),
            _BatchList([b for i, b in enumerate(batches) if i % k == k - 1]))


def split_steps(loader: Any, val_fraction: float) -> int | None:
    """Batches in the training split that :func:`split_loader` makes of ``loader`` (without
    reading it); None for a loader without a length."""
    try:
        if isinstance(loader, DataLoader) and hasattr(loader.dataset, "__len__") and val_fraction > 0:
            n = len(loader.dataset)
            n_train, batch = n - max(1, int(round(n * val_fraction))), loader.batch_size or 1
            return n_train // batch if loader.drop_last else math.ceil(n_train / batch)
        batches = len(loader)
    except TypeError:
        return None
    if val_fraction == 0.0:
        return batches
    k = max(2, min(batches, int(round(1.0 / val_fraction))))
    return batches - batches // k


DATASETS = ("digits", "fashion_mnist", "cifar10", "synthetic")


def synthetic(*, n_train: int = 256, n_test: int = 128, shape: tuple[int, ...] = (3, 32, 32),
              num_classes: int = 10, noise: float = 1.0, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """CIFAR-shaped stand-in data made on the spot: ``(train, test)`` TensorDatasets.

    Each class has a fixed random template (smooth, so convolutions see structure); an image is
    its class's template plus Gaussian noise of std ``noise``. Learnable, so accuracies mean
    something, yet nothing is downloaded: the smoke setting of the tutorials and CLI tests.
    """
    if n_train < 1 or n_test < 1 or num_classes < 2:
        raise ConfigError(f"synthetic data needs n_train, n_test >= 1 and num_classes >= 2; got "
                         f"{n_train}, {n_test}, {num_classes}")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, shape[0], *(max(1, s // 4) for s in shape[1:]), generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=tuple(shape[1:]), mode="bilinear",
                                                align_corners=False) if len(shape) == 3 else coarse

    def make(n: int) -> TensorDataset:
        y = torch.randint(0, num_classes, (n,), generator=g)
        x = templates[y] + noise * torch.randn(n, *shape, generator=g)
        return TensorDataset(x.float(), y)

    return make(n_train), make(n_test)


#: A folder without train/ and test/ subfolders: one image in this many (in file order) is the
#: test split, the others train.
TEST_EVERY = 5
_SPLITS = (("train", "test"), ("train", "val"))


class _Images(Dataset):
    """An ``ImageFolder`` (or a part of one) whose images all have one size: the first's, or
    ``image_size`` x ``image_size`` where given (resized). ``classes``: the class folder names."""

    def __init__(self, folder: Any, indices: list[int], image_size: int | None):
        self.folder, self.indices, self.image_size = folder, indices, image_size
        self.classes: list[str] = list(folder.classes)
        self.size: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from torchvision.transforms.functional import resize, to_tensor

        path, label = self.folder.samples[self.indices[i]]
        image = self.folder.loader(path)
        if self.image_size is not None:
            image = resize(image, [self.image_size, self.image_size])
        elif self.size is None:
            self.size = image.size
        elif image.size != self.size:
            raise DataError(f"{path} is {image.size[0]}x{image.size[1]} pixels, the folder's first image "
                            f"{self.size[0]}x{self.size[1]}; give an image size (--image-size N, "
                            "image_size=N) to resize every image to N x N")
        return to_tensor(image), label


def _image_folder(root: str) -> Any:
    from torchvision.datasets import ImageFolder

    try:
        return ImageFolder(root)
    except (FileNotFoundError, OSError) as exc:
        raise DataError(f"{root} is not an image folder in torchvision's ImageFolder layout "
                        f"(ROOT/CLASS/image.png, one subfolder per class): {exc}") from None


#: PIL modes of one channel (gray) and of colour; an image folder mixing the two is read as RGB.
_GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})


def _say_mixed_channels(root: str, folders: list[Any]) -> None:
    """Warn once where ``folders`` mix grayscale and colour images (read from each file's
    header only): every image is read as RGB, the grayscale ones converted."""
    from PIL import Image

    gray = total = 0
    for folder in folders:
        for path, _ in folder.samples:
            try:
                with Image.open(path) as image:
                    gray += image.mode in _GRAY_MODES
            except OSError:
                continue  # said when the image is read
            total += 1
    if 0 < gray < total:
        warnings.warn(f"{root} mixes grayscale and colour images: {gray} of {total} are grayscale; every "
                      f"image is read as RGB (3 channels), those {gray} converted (their gray value in R, "
                      "G and B). Convert the files to one mode to choose otherwise", UserWarning, stacklevel=3)


def labels_of(dataset: Any) -> list[int] | None:
    """The label of each item of ``dataset``, where known without reading the items (an image
    folder's file list, a TensorDataset's labels, a torchvision dataset's ``targets``, a Subset
    of one); None otherwise."""
    if isinstance(dataset, Subset):
        inner = labels_of(dataset.dataset)
        return None if inner is None else [inner[i] for i in dataset.indices]
    if isinstance(dataset, _Images):
        return [int(dataset.folder.samples[i][1]) for i in dataset.indices]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) > 1 and dataset.tensors[1].dim() == 1:
        return [int(v) for v in dataset.tensors[1].tolist()]
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) == len(dataset):
        return [int(v) for v in (targets.tolist() if isinstance(targets, torch.Tensor) else targets)]
    return None


def stratified_subset(dataset: Any, n: int, *, seed: int = 0) -> Subset:
    """``n`` items of ``dataset`` that keep its classes' proportions (each class gets its share,
    rounded by largest remainder), drawn with ``seed``, in the dataset's order; the first ``n``
    where the labels are not known without reading the items (:func:`labels_of`)."""
    total = len(dataset)
    if n >= total:
        return Subset(dataset, list(range(total)))
    labels = labels_of(dataset)
    if labels is None:
        return Subset(dataset, list(range(n)))
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    shares = {c: n * len(idx) / total for c, idx in by_class.items()}
    counts = {c: int(math.floor(v)) for c, v in shares.items()}
    for c in sorted(shares, key=lambda c: (counts[c] - shares[c], c))[:n - sum(counts.values())]:
        counts[c] += 1  # the largest remainders
    g = torch.Generator().manual_seed(seed)
    chosen: list[int] = []
    for c, idx in sorted(by_class.items()):
        order = torch.randperm(len(idx), generator=g)[:counts[c]].tolist()
        chosen.extend(idx[k] for k in order)
    return Subset(dataset, sorted(chosen))


def image_folder(root: str | os.PathLike, *, image_size: int | None = None) -> tuple[Dataset, Dataset]:
    """``(train, test)`` from a folder of images in torchvision's ``ImageFolder`` layout.

    ``ROOT/train/CLASS/*`` and ``ROOT/test/CLASS/*`` (or ``ROOT/val/CLASS/*``) are the two
    splits; otherwise ``ROOT/CLASS/*`` holds every image and one in :data:`TEST_EVERY`, in file
    order, is the test split. Class indices follow the sorted class folder names. Images are
    read as RGB (a folder that mixes grayscale and colour images warns once, with the count of
    grayscale files converted), resized to ``image_size`` x ``image_size`` where given, and scaled to [0, 1]
    (no normalisation). Images are read as they are drawn.

    Raises:
        DataError: not a folder, no class folder holding images, splits with different classes,
            or (without ``image_size``) an image of another size than the first.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DataError(f"image folder {root} does not exist")
    for train_name, test_name in _SPLITS:
        if all(os.path.isdir(os.path.join(root, d)) for d in (train_name, test_name)):
            train = _image_folder(os.path.join(root, train_name))
            test = _image_folder(os.path.join(root, test_name))
            if train.classes != test.classes:
                raise DataError(f"{root}/{train_name} and {root}/{test_name} hold different classes "
                                f"({train.classes} and {test.classes}); give both the same class folders")
            _say_mixed_channels(root, [train, test])
            return (_Images(train, list(range(len(train))), image_size),
                    _Images(test, list(range(len(test))), image_size))
    folder = _image_folder(root)
    _say_mixed_channels(root, [folder])
    n = len(folder)
    if n < 2:
        raise DataError(f"{root} holds {n} image(s); a training and a test split need at least 2")
    return (_Images(folder, [i for i in range(n) if i % TEST_EVERY], image_size),
            _Images(folder, [i for i in range(n) if i % TEST_EVERY == 0], image_size))


def load(name: str, *, root: str | None = None, download: bool = False, augment: bool = False,
         seed: int = 0, download_hint: str | None = None) -> tuple[Dataset, Dataset]:
    """``(train, test)`` datasets by name: one of :data:`DATASETS`.

    The images come normalised, not in [0, 1]: ``"digits"`` standardised with its training
    split's mean and std; ``"fashion_mnist"`` as ``(x - 0.2860) / 0.3530`` (:data:`FASHION_MEAN`,
    :data:`FASHION_STD`; from -0.81 to 2.02); ``"cifar10"`` per channel with the means
    ``(0.4914, 0.4822, 0.4465)`` and stds ``(0.2470, 0.2435, 0.2616)`` (:data:`CIFAR_MEAN`,
    :data:`CIFAR_STD`); ``"synthetic"`` is made standardised. Give a model images normalised the
    same way; :func:`fashion_mnist` with ``normalize=False`` gives them in [0, 1].

    ``root`` is where Fashion-MNIST's IDX files or CIFAR-10's folder live (defaults: Debian's
    Fashion-MNIST folder, ``data/cifar10``); ``augment`` applies CIFAR-10's crop-and-flip to
    its training split. ``download_hint`` replaces the messages' advice on downloading.

    Raises:
        DataError: an unknown name, or the files are missing (the message says how to get them).
    """
    if name == "digits":
        return digits(seed=seed)
    hint: dict[str, Any] = {"download_hint": download_hint} if download_hint else {}
    if name == "fashion_mnist":
        return (fashion_mnist(root, train=True, download=download, **hint),
                fashion_mnist(root, train=False, download=download, **hint))
    if name == "cifar10":
        root = root or "data/cifar10"
        return (cifar10(root, train=True, download=download, augment=augment, **hint),
                cifar10(root, train=False, download=download, **hint))
    if name == "synthetic":
        return synthetic(seed=seed)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
