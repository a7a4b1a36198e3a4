"""Datasets and loader helpers: digits, Fashion-MNIST IDX files, CIFAR-10, splits."""

from __future__ import annotations

import gzip
import hashlib
import pickle

import numpy as np
import pytest
import torch
from conftest import needs_fashion
from torch.utils.data import DataLoader, TensorDataset

from snnconv import data
from snnconv.errors import DataError

# --------------------------------------------------------------------------------------------
# digits


def test_digits_gives_1x8x8_float_images_and_labels_0_to_9(digits_data):
    train, test = digits_data
    assert len(train) + len(test) == 1797
    assert len(test) == round(1797 * 0.25)
    x, y = train.tensors
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.long and set(y.tolist()) == set(range(10))
    assert set(test.tensors[1].tolist()) <= set(range(10))
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-3


def test_digits_split_is_seeded():
    a, _ = data.digits(seed=1)
    b, _ = data.digits(seed=1)
    c, _ = data.digits(seed=2, test_fraction=0.5)
    assert torch.equal(a.tensors[0], b.tensors[0])
    assert len(c) == 1797 - round(1797 * 0.5)


# --------------------------------------------------------------------------------------------
# IDX files


def _idx_bytes(array: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + array.tobytes()


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("dtype,code", [(np.uint8, 0x08), (np.dtype(">i4"), 0x0C), (np.dtype(">f4"), 0x0D)])
def test_read_idx_reads_back_what_was_written(tmp_path, compressed, dtype, code):
    array = (np.arange(2 * 3 * 4) % 251).astype(dtype).reshape(2, 3, 4)
    raw = _idx_bytes(array, code)
    path = tmp_path / ("a.idx.gz" if compressed else "a.idx")
    path.write_bytes(gzip.compress(raw) if compressed else raw)
    back = data.read_idx(path)
    assert back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "gz"])
def test_read_idx_refuses_a_truncated_file(tmp_path, compressed):
    raw = _idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8), 0x08)
    if compressed:
        path = tmp_path / "t.gz"
        path.write_bytes(gzip.compress(raw)[:-30])  # the gzip stream itself is cut
    else:
        path = tmp_path / "t"
        path.write_bytes(raw[:-100])
    with pytest.raises(DataError, match=str(path.name)):
        data.read_idx(path)


def test_read_idx_refuses_a_gzip_of_a_truncated_idx(tmp_path):
    raw = _idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8), 0x08)
    path = tmp_path / "t.gz"
    path.write_bytes(gzip.compress(raw[:-1]))
    with pytest.raises(DataError, match="truncated"):
        data.read_idx(path)


def test_read_idx_refuses_a_file_that_is_not_idx(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(DataError, match="not an IDX file"):
        data.read_idx(path)


def test_read_idx_of_a_missing_file_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data.read_idx(tmp_path / "nothing.gz")


# --------------------------------------------------------------------------------------------
# Fashion-MNIST


@needs_fashion
@pytest.mark.parametrize("train,size", [(True, 60000), (False, 10000)], ids=["train", "test"])
def test_fashion_mnist_from_debian_idx_files(train, size):
    ds = data.fashion_mnist(train=train, normalize=False)
    x, y = ds.tensors
    assert x.shape == (size, 1, 28, 28) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.long and set(y.unique().tolist()) == set(range(10))
    assert torch.bincount(y).tolist() == [size // 10] * 10  # Fashion-MNIST is balanced


def _write_fashion(root, n=12):
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(images, 0x08)))
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx_bytes(labels, 0x08))  # raw works too


def test_fashion_mnist_reads_idx_files_from_another_root(tmp_path):
    _write_fashion(tmp_path)
    ds = data.fashion_mnist(str(tmp_path), train=False)
    x, y = ds.tensors
    assert x.shape == (12, 1, 28, 28)
    assert y.tolist() == [i % 10 for i in range(12)]
    raw = data.fashion_mnist(str(tmp_path), train=False, normalize=False).tensors[0]
    torch.testing.assert_close(x, (raw - data.FASHION_MEAN) / data.FASHION_STD)


def test_the_help_of_load_and_fashion_mnist_states_the_normalisation(tmp_path):
    """What ``help(snnconv.data.load)`` says is what the tensors hold."""
    _write_fashion(tmp_path)
    x = data.fashion_mnist(str(tmp_path), train=False).tensors[0]
    low = (0.0 - data.FASHION_MEAN) / data.FASHION_STD
    assert float(x.min()) >= low - 1e-6 and f"{low:.2f}" == "-0.81"
    for doc in (data.load.__doc__, data.fashion_mnist.__doc__):
        assert "(x - 0.2860) / 0.3530" in doc and "-0.81" in doc and "normalize=False" in doc
    assert "(0.4914, 0.4822, 0.4465)" in data.load.__doc__ and "(0.2470, 0.2435, 0.2616)" in data.cifar10.__doc__
    assert (data.FASHION_MEAN, data.FASHION_STD) == (0.2860, 0.3530)
    assert (data.CIFAR_MEAN, data.CIFAR_STD) == ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def test_fashion_mnist_missing_folder_says_how_to_install_it(tmp_path):
    with pytest.raises(DataError) as info:
        data.fashion_mnist(str(tmp_path / "nowhere"))
    assert "apt-get install dataset-fashion-mnist" in str(info.value)


# --------------------------------------------------------------------------------------------
# CIFAR-10 through torchvision, on a tiny dataset in the real on-disk format


def _write_cifar(root, per_batch=3):
    """``cifar-10-batches-py`` with 5 train batches and a test batch; returns the md5 table.

    The real files are Python 2 pickles; torchvision reads them with ``encoding="latin1"``, so
    their keys arrive as ``str`` ('data': uint8 [N, 3072], 'labels': list of int), as here.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    md5 = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        payload = {"batch_label": name,
                   "data": rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                   "labels": [(k + j) % 10 for j in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(payload, protocol=2))
    meta = {"label_names": [f"class{i}" for i in range(10)], "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    for path in folder.iterdir():
        md5[path.name] = hashlib.md5(path.read_bytes()).hexdigest()
    return md5


@pytest.fixture
def tiny_cifar(tmp_path, monkeypatch):
    """A tiny CIFAR-10 whose checksums torchvision is told, so its real integrity check runs."""
    from torchvision.datasets import CIFAR10

    md5 = _write_cifar(tmp_path)
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]]
                                                for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names",
                                          "md5": md5["batches.meta"]})
    return tmp_path


@pytest.mark.parametrize("train,size", [(True, 15), (False, 3)], ids=["train", "test"])
def test_cifar10_loads_the_on_disk_format_normalised(tiny_cifar, train, size):
    ds = data.cifar10(str(tiny_cifar), train=train)
    assert len(ds) == size
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert 0 <= y <= 9
    name = "data_batch_1" if train else "test_batch"
    raw = pickle.loads((tiny_cifar / "cifar-10-batches-py" / name).read_bytes())["data"][0]
    pixels = torch.tensor(raw, dtype=torch.float32).reshape(3, 32, 32) / 255.0
    mean = torch.tensor(data.CIFAR_MEAN).view(3, 1, 1)
    std = torch.tensor(data.CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x, (pixels - mean) / std)


def test_cifar10_with_augmentation_keeps_the_shape(tiny_cifar):
    ds = data.cifar10(str(tiny_cifar), augment=True)
    assert ds[0][0].shape == (3, 32, 32)


def test_cifar10_missing_folder_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        data.cifar10(str(tmp_path))


def test_cifar10_with_files_that_fail_the_checksum_raises_data_error(tmp_path):
    _write_cifar(tmp_path)  # real torchvision md5 table: these files do not match it
    with pytest.raises(DataError):
        data.cifar10(str(tmp_path))


# --------------------------------------------------------------------------------------------
# splits keep train and validation disjoint


def _indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def test_split_dataset_is_a_disjoint_cover():
    train, val = data.split_dataset(_indexed(50), 0.2, seed=3)
    a, b = set(train.indices), set(val.indices)
    assert len(b) == 10 and not a & b and a | b == set(range(50))
    again, _ = data.split_dataset(_indexed(50), 0.2, seed=3)
    assert train.indices == again.indices


def test_split_dataset_refuses_too_little_data():
    with pytest.raises(DataError, match="too few"):
        data.split_dataset(_indexed(1), 0.5)


def test_split_loader_over_a_dataloader_keeps_train_and_val_disjoint():
    loader = DataLoader(_indexed(40), batch_size=8, shuffle=True)
    train, val = data.split_loader(loader, 0.25, seed=1)
    seen_train = [int(i) for _, y in train for i in y]
    seen_val = [int(i) for _, y in val for i in y]
    assert len(seen_val) == 10 and len(seen_train) == 30
    assert not set(seen_train) & set(seen_val)
    assert set(seen_train) | set(seen_val) == set(range(40))
    assert train.batch_size == val.batch_size == 8


def test_split_loader_over_a_list_of_batches_keeps_train_and_val_disjoint():
    batches = [(torch.zeros(2, 1), torch.tensor([2 * i, 2 * i + 1])) for i in range(10)]
    train, val = data.split_loader(batches, 0.2)
    seen_train = [int(i) for _, y in train for i in y]
    seen_val = [int(i) for _, y in val for i in y]
    assert len(val) == 2 and len(train) == 8
    assert not set(seen_train) & set(seen_val)
    assert sorted(seen_train + seen_val) == list(range(20))
    assert list(train) == list(train)  # re-iterable


def test_split_loader_with_no_validation_returns_the_loader():
    loader = DataLoader(_indexed(4), batch_size=2)
    assert data.split_loader(loader, 0.0) == (loader, None)
    with pytest.raises(ValueError):
        data.split_loader(loader, 1.0)
    with pytest.raises(DataError, match="at least 2"):
        data.split_loader([(torch.zeros(1), torch.zeros(1))], 0.5)


@pytest.mark.parametrize("batch", [
    (torch.ones(2, 3), torch.tensor([0, 1])),
    [torch.ones(2, 3), torch.tensor([0, 1])],
    {"input": torch.ones(2, 3), "label": torch.tensor([0, 1])},
], ids=["tuple", "list", "dict"])
def test_split_batch_accepts_the_usual_forms(batch):
    x, y = data.split_batch(batch)
    assert x.shape == (2, 3) and y.tolist() == [0, 1]


def test_split_batch_and_first_batch_refuse_what_they_cannot_read():
    x, y = data.split_batch(torch.ones(2))
    assert y is None and x.shape == (2,)
    with pytest.raises(DataError, match="expected 'x'"):
        data.split_batch({"pixels": torch.ones(1)})
    with pytest.raises(DataError, match="str"):
        data.split_batch("not a batch")
    with pytest.raises(DataError, match="empty"):
        data.first_batch([])


@pytest.mark.parametrize("n,batch,drop_last,val_fraction", [(5000, 128, False, 0.1), (1000, 64, True, 0.1),
                                                           (1437, 16, False, 0.2), (100, 32, False, 0.0)])
def test_split_steps_counts_the_batches_split_loader_gives(n, batch, drop_last, val_fraction):
    """split_steps (read without iterating) equals the length of split_loader's training split,
    for a DataLoader over a sized dataset and for a list of batches."""
    ds = TensorDataset(torch.zeros(n, 1), torch.zeros(n))
    loader = DataLoader(ds, batch_size=batch, drop_last=drop_last)
    assert data.split_steps(loader, val_fraction) == len(data.split_loader(loader, val_fraction)[0])
    batches = list(DataLoader(ds, batch_size=batch))
    assert data.split_steps(batches, val_fraction) == len(data.split_loader(batches, val_fraction)[0])
    assert data.split_steps(iter(batches), val_fraction) is None


def test_a_batch_of_another_shape_after_the_first_is_refused_by_index():
    """Batches of 8x8, 8x8, 9x9, 8x8 images: a DataError naming batch 2, from every pass."""
    import snnconv
    from snnconv.analysis.metrics import evaluate
    from snnconv.errors import DataError
    from snnconv.models import small_cnn

    g = torch.Generator().manual_seed(0)
    sizes = [8, 8, 9, 8]
    loader = [(torch.rand(16, 1, s, s, generator=g), torch.randint(0, 10, (16,), generator=g)) for s in sizes]
    model = small_cnn(num_classes=10, in_channels=1, width=4).eval()
    with pytest.raises(DataError, match=r"batch 2 holds inputs of shape \[1, 9, 9\]"):
        snnconv.convert(model, loader, T=2, finetune_epochs=0, reconstruction_steps=0, progress=False)
    snn, _ = snnconv.convert(model, loader[:2], T=2, finetune_epochs=0, reconstruction_steps=0,
                             progress=False, on_collapse="warn")
    with pytest.raises(DataError, match="batch 2"):
        snnconv.finetune(snn, loader, T=2, epochs=1, progress=False)
    with pytest.raises(DataError, match="batch 2"):
        evaluate(snn, loader)
    dtypes = [(x.double() if i == 1 else x, y) for i, (x, y) in enumerate(loader[:2])]
    with pytest.raises(DataError, match=r"batch 1 .*float64"):
        snnconv.convert(model, dtypes, T=2, finetune_epochs=0, reconstruction_steps=0, progress=False)
