#!/usr/bin/env bash
# A separate virtual environment for scripts/ultralytics_fixtures.py.
#
# Ultralytics is AGPL-3.0: it is a tool of the fixture script only, never a dependency of
# quantpipe or of its test environment (.venv). This script installs it, pinned, into a venv
# of its own (default $HOME/.cache/quantpipe-ultralytics/venv, or $QP_ULTRALYTICS_VENV) and
# prints that venv's path on its last line:
#
#     VENV=$(bash scripts/ultralytics_env.sh | tail -n 1)
#     $VENV/bin/python scripts/ultralytics_fixtures.py --data DIR --out tests/fixtures/ultralytics
#
# Plain pip on Python 3.11 (torch/torchvision come from the machine's local wheel index).
set -euo pipefail

VENV="${QP_ULTRALYTICS_VENV:-$HOME/.cache/quantpipe-ultralytics/venv}"
PY="${QP_ULTRALYTICS_PYTHON:-python3.11}"

# Everything Ultralytics' exporter checks for (check_requirements) is installed here, so that
# it never pip-installs at run time: onnx/onnxslim/onnxruntime for format="onnx",
# openvino/nncf for format="openvino" (int8=True).
PINS=(
  "torch==2.14.1"
  "torchvision==0.29.1"
  "ultralytics==8.4.190"
  "onnx==1.23.2"
  "onnxslim==0.1.98"
  "onnxruntime==1.32.0"
  "openvino==2026.4.1"
  "nncf==3.4.0"
)

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" >&2
"$VENV/bin/python" - <<'EOF' >&2
import importlib.metadata as m
for p in ("torch", "torchvision", "ultralytics", "onnx", "onnxslim", "onnxruntime", "openvino", "nncf"):
    print(f"{p}=={m.version(p)}")
EOF
echo "$VENV"
