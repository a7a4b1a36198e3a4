#!/usr/bin/env bash
# On a CUDA machine with its own torch and no registry: install the bundle that
# scripts/gpu_bundle.sh built beside that torch, then run scripts/gpu_run.py (under 8 minutes).
#
#   bash gpu-bundle/run.sh --out gpu-run                  # every result as JSON in gpu-run/
#   bash gpu-bundle/run.sh --out g --device cpu --small   # the same steps, small, on a CPU
#
# The wheels go into gpu-bundle/site with pip --no-index --no-deps --target, and the run puts that
# folder first on PYTHONPATH: the machine's own packages (its torch) stay as they are.
# PYTHON names the interpreter (default python3; the bundle's Python version).
set -euo pipefail
bundle=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
site=$bundle/site
wheels=$(cd "$bundle/wheels" && ls -1 ./*.whl)
start=$SECONDS
if [ "$(cat "$site/.installed" 2>/dev/null)" != "$wheels" ]; then
  "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade \
    --target "$site" "$bundle"/wheels/*.whl
  echo "$wheels" > "$site/.installed"
fi
echo "gpu_run.sh: $(echo "$wheels" | wc -l) wheels in $site ($((SECONDS - start)) s)"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "$bundle/src/scripts/gpu_run.py" "$@"
