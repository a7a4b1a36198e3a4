"""Hostile network files (``snn.pt``, the prefix file) and fine-tuning checkpoints: what each
costs the reader, in a fresh process per file.

    python -m benchmarks interop network_file_attacks [--out FILE.json]

The files are the suite's attacks (``tests/test_graph_injection.py``,
``tests/test_untrusted_files.py``), digests recomputed as an attacker would. Each is read by
``SpikingNetwork.load`` (then called once on an input, as a user would) in a child process;
``peak_mib`` is that child's peak resident memory growth during the call (``VmHWM`` after a
reset through ``/proc/self/clear_refs``), ``ran_code`` whether the attack's marker file appeared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from ..common import RESULTS, child_env, test_helper

_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from snnconv.errors import SnnconvError
from snnconv.snn.network import SpikingNetwork
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
start = time.perf_counter()
try:
    SpikingNetwork.load(sys.argv[1])(torch.rand(2, 1, 8, 8))
    outcome = "loaded"
except SnnconvError as exc:
    outcome = f"{type(exc).__name__}: " + str(exc).split(": ", 1)[-1][:200]
except BaseException as exc:
    outcome = f"RAW {type(exc).__name__}: " + str(exc)[:200]
print(json.dumps({"seconds": round(time.perf_counter() - start, 3),
                  "peak_mib": round((status("VmHWM") - base) / 1024, 1), "outcome": outcome}))
"""


def main(argv: list[str] | None = None) -> int:
    import torch
    injection, untrusted = test_helper("test_graph_injection"), test_helper("test_untrusted_files")
    ATTACKS, MARKER, _attack, _forge, _Stem = (injection.ATTACKS, injection.MARKER, injection._attack,
                                               injection._forge, injection._Stem)
    VALUE_ATTACKS, _deflated_bomb, _value_attack = (untrusted.VALUE_ATTACKS, untrusted._deflated_bomb,
                                                    untrusted._value_attack)

    import snnconv
    from snnconv.io.files import MAX_FILE_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "network_file_attacks.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    x = torch.rand(16, 1, 8, 8)
    snn, _ = snnconv.convert(_Stem().eval(), [(x, torch.zeros(16, dtype=torch.long))], T=2,
                             finetune_epochs=0, reconstruction_steps=0, progress=False, on_collapse="warn")
    rows = []
    env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        snn.save(os.path.join(tmp, "snn.pt"))
        cases = [("graph", how) for how in ATTACKS] + [("values", how) for how in VALUE_ATTACKS
                                                       if how != "huge adaptive pool"] + [("zip", "bomb")]
        for kind, how in cases:
            path = os.path.join(tmp, "evil.pt")
            if kind == "zip":
                _deflated_bomb(os.path.join(tmp, "snn.pt"), path, MAX_FILE_BYTES + 2**24)
            else:
                payload = torch.load(os.path.join(tmp, "snn.pt"), weights_only=True)
                (_attack(payload["graph"], how) if kind == "graph" else _value_attack(payload, how))
                limit = sys.getrecursionlimit()
                sys.setrecursionlimit(60_000)
                try:
                    torch.save(_forge(payload), path)
                except RuntimeError:  # a sparse tensor has no digest of ours
                    torch.save(payload, path)
                finally:
                    sys.setrecursionlimit(limit)
            res = subprocess.run([sys.executable, "-c", _CHILD, path], cwd=tmp, env=env,
                                 capture_output=True, text=True, timeout=300)
            row = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else \
                {"outcome": f"child exited {res.returncode}: {res.stderr[-300:]}"}
            row.update(kind=kind, case=how, file_bytes=os.path.getsize(path),
                       ran_code=os.path.exists(os.path.join(tmp, MARKER)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
