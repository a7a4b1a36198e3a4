#!/usr/bin/env bash
# Build, where PyPI is reachable, what a CUDA machine with its own torch and no registry needs to
# run snnconv: snnconv's wheel and every wheel it needs beside that torch, for that Python, with
# this checkout's tests, benchmarks and scripts (and what the tests need: snnconv's [test] extra).
#
#   scripts/gpu_bundle.sh [DIR]                       (default build/gpu-bundle)
#   TORCH=2.11.0 TORCHVISION=0.26.0 PYTHON_VERSION=3.12 scripts/gpu_bundle.sh   (the defaults)
#
# Needs that Python here too (python3.12 on PATH or under pyenv): pip resolves and downloads
# with it, so the wheels fit the target's interpreter. On the target (docs/gpu.md):
#
#   bash DIR/run.sh --out gpu-run         # --device cpu --small: the same steps on a CPU
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(realpath -m "${1:-$root/build/gpu-bundle}")
torch=${TORCH:-2.11.0} torchvision=${TORCHVISION:-0.26.0} pyver=${PYTHON_VERSION:-3.12}
py=$("$root/.ci/find-python" "$pyver")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$py" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip  # a pip that reads the registry's metadata files, not whole wheels
rm -rf "$dir"
mkdir -p "$dir/wheels" "$dir/src"
"${pip[@]}" wheel --no-deps --wheel-dir "$dir/wheels" "$root"

# Resolved beside the target's torch and torchvision; what those two require themselves is on the
# target already and is left out (numpy excepted: snnconv needs numpy 2, and h5py's wheel too).
"${pip[@]}" install --dry-run --ignore-installed --only-binary=:all: --report "$work/report.json" \
  "torch==$torch" "torchvision==$torchvision" "snnconv[test] @ file://$(ls "$dir"/wheels/snnconv-*.whl)"
"$work/venv/bin/python" - "$work/report.json" "$dir/bundle.json" "$torch" "$torchvision" > "$work/wheels.txt" <<'EOF'
import json
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

report_path, manifest_path, torch, torchvision = sys.argv[1:]
report = json.load(open(report_path))
items = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
markers = {**report["environment"], "extra": ""}
left_out, todo = set(), [("torch", set()), ("torchvision", set())]
while todo:  # the requirements of torch and torchvision, their extras' (cuda-toolkit[...]) included
    name, extras = todo.pop()
    name = canonicalize_name(name)
    if name not in items:
        continue
    left_out.add(name)
    for text in items[name].get("requires_dist", []):
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**markers, "extra": e}) for e in {"", *extras}):
            if canonicalize_name(req.name) not in left_out or req.extras:
                todo.append((req.name, set(req.extras)))
left_out.discard("numpy")
bundled = sorted(f"{m['name']}=={m['version']}" for n, m in items.items()
                 if n not in left_out and n != "snnconv")
print("\n".join(bundled))
json.dump({"target": {"python": report["environment"]["python_version"], "torch": torch,
                      "torchvision": torchvision},
           "bundled": bundled, "left_out": sorted(left_out),
           "note": "left_out: the target's torch and torchvision and what they require"},
          open(manifest_path, "w"), indent=1)
EOF
"${pip[@]}" download --no-deps --only-binary=:all: --dest "$dir/wheels" -r "$work/wheels.txt"

# the checkout's tracked files: the tests, the benchmarks package and scripts/gpu_run.py run from here
git -C "$root" ls-files -z | tar -C "$root" --null -T - -cf - | tar -C "$dir/src" -xf -
cat > "$dir/run.sh" <<'EOF'
#!/usr/bin/env bash
exec bash "$(dirname "$0")/src/scripts/gpu_run.sh" "$@"
EOF
chmod +x "$dir/run.sh"
echo "gpu_bundle: $dir ($(du -sh "$dir" | cut -f1)): $(ls "$dir/wheels" | wc -l) wheels for Python $pyver beside" \
     "torch $torch and torchvision $torchvision; on the target: bash $dir/run.sh --out gpu-run"
