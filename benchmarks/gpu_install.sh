#!/usr/bin/env bash
# On the GPU machine, in the repository's root, after every part of .gpu/ has been carried there
# (benchmarks/gpu_wheels.sh, docs/gpu.md): join onnxruntime-gpu's wheel, install it and the other
# wheels into /tmp/site (the image's own packages stay), graphopt from this tree without its
# dependencies. Then source-able: prints the PYTHONPATH to export.
set -eu
name=$(cat .gpu/ort.name)
cat .gpu/ort.part-* > "/tmp/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "/tmp/$name" .gpu/small/*.whl
# the image's onnxruntime (CPU) and the carried onnxruntime-gpu both install the `onnxruntime`
# package: /tmp/site first on the path makes the GPU one win
PYTHONPATH=/tmp/site python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
PYTHONPATH=/tmp/site python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
