#!/usr/bin/env bash
# Prepare, on this (networked) machine, what a GPU machine without a network needs to run
# benchmarks/gpu_check.sh: the wheels of graphopt's dependencies its image lacks, for its Python
# (3.12), in .gpu/ (ignored by git). onnxruntime-gpu's wheel (about 250 MB) is over what one call
# to the device carries (64 MiB): it is split into parts of 56 MiB (the tree itself is about 3 MiB), one carried per call, joined
# there (docs/gpu.md, "Bringing onnxruntime-gpu to the device").
#
#     bash benchmarks/gpu_wheels.sh [ORT_VERSION]
set -eu
version=${1:-1.31.1}
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu"
rm -rf "$out"
mkdir -p "$out/small" "$out/whole"
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
get() {  # get FOLDER SPEC...: cp312 wheels, no dependencies (the image has the rest)
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms -d "$dir" "$@"
}
get "$out/whole" "onnxruntime-gpu==$version"
# graphopt's dependencies the device image lacks (docs/gpu.md); pure-Python ones as any wheel
python3 -m pip download -q --no-deps -d "$out/small" "onnx-ad==$(python3 -c 'import importlib.metadata as m; print(m.version("onnx-ad"))')"
get "$out/small" "highspy==$(python3 -c 'import importlib.metadata as m; print(m.version("highspy"))')"
wheel=$(ls "$out/whole"/onnxruntime_gpu-*.whl)
(cd "$out" && split -b 56M -d "$wheel" ort.part- && basename "$wheel" > ort.name)
rm -rf "$out/whole"
ls -la "$out" "$out/small"
echo "carry, one call each: .gpu/small with .gpu/ort.name and the first part, then every other part; see docs/gpu.md"
