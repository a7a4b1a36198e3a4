"""SHA-256 of convert()'s state dict on a fixed digits ResNet-8: the check that a change of the
code's layout changed no behaviour.

A ``resnet8(10, 1)`` trained 2 epochs on scikit-learn's digits (seed 0), converted at T=4 with
both resets, training-free (``finetune_epochs=0``) and with the default fine-tuning; one torch
thread, deterministic algorithms. Run it at two commits on the same machine and compare the JSON
it prints (float results may differ between CPUs, so compare on one machine):

    PYTHONPATH=.:backends python scripts/behaviour_digest.py > digest.json
"""

from __future__ import annotations

import hashlib
import json
import warnings

import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.data import digits
from snnconv.demo import train_ann
from snnconv.models import resnet8


def digest(state: dict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of a state dict, in name order."""
    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        h.update(key.encode())
        if torch.is_tensor(value):
            h.update(str(value.dtype).encode())
            h.update(str(tuple(value.shape)).encode())
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    train, _ = digits(seed=0)

    def loader() -> DataLoader:
        return DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    ann = train_ann(resnet8(num_classes=10, in_channels=1), loader(), epochs=2, progress=False)
    out = {"ann": digest(ann.state_dict())}
    for reset in ("subtract", "zero"):
        for label, settings in (("training-free", {"finetune_epochs": 0}), ("default", {})):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                snn, _ = snnconv.convert(ann, loader(), T=4, reset=reset, progress=False, **settings)
            out[f"{reset}/{label}"] = digest(snn.state_dict())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
