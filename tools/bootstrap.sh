#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment.
# Keeps a torch that already imports (JetPack ships its own CUDA build); otherwise installs the
# CPU build torch==2.13.0, and pins whatever torch is there so no later install can replace it
# with a CUDA build pulled from the index by accident.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "bootstrap: system torch imports; the venv will see it (--system-site-packages)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing the CPU build of torch 2.13.0"
  # '+cpu' names the CPU build exactly; the plain version on the default index is a CUDA build.
  "$PY" -m pip install "torch==2.13.0+cpu" \
    || "$PY" -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
fi
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
echo "torch==${TORCH_VERSION}" > "$VENV/constraints.txt"
echo "bootstrap: torch ${TORCH_VERSION} pinned"

# `fleet`: Flower for the federated fleet rounds (docs/fleet.md); its tests need it.
"$PY" -m pip install -c "$VENV/constraints.txt" -e ".[dev,fleet]"
# ONNX Runtime is a default dependency except on Linux aarch64 (pyproject.toml): a Jetson keeps
# NVIDIA's onnxruntime-gpu (the CPU wheel would shadow it); another aarch64 box without any
# onnxruntime gets the CPU one, so the auto backend has its fast path there too.
if ! "$PY" -c "import onnxruntime" >/dev/null 2>&1 && [ ! -e /etc/nv_tegra_release ]; then
  "$PY" -m pip install -c "$VENV/constraints.txt" -e ".[onnx]"
fi
