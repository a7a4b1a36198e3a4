"""Save a file and stop just before its rename, to be killed there (SIGKILL, by the test).

    python _interrupted_save.py nir|snn PATH

reads PATH (a NIR file or a saved SpikingNetwork) and writes it again to PATH; the temporary
file is complete when the process prints "ready" and waits.
"""

from __future__ import annotations

import os
import sys
import time


def _stop_before_rename(src, dst):
    print("ready", flush=True)
    time.sleep(600)


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    os.replace = _stop_before_rename  # the rename of snnconv.io.atomic.atomic_write_bytes
    if kind == "nir":
        from snnconv.snn.nir_io import load_nir, save_nir

        save_nir(load_nir(path), path, compression=None)
    else:
        from snnconv.snn.network import SpikingNetwork

        SpikingNetwork.load(path).save(path)


if __name__ == "__main__":
    main()
