#!/usr/bin/env bash
# The GPU checks (issue 45, item 6), in one prepared run on a machine with an NVIDIA GPU and
# onnxruntime-gpu (`pip install -e '.[gpu]'`; on the lent device machine, without a network:
# benchmarks/gpu_wheels.sh here, benchmarks/gpu_install.sh there, docs/gpu.md):
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]
#
# Each part runs under its own time limit (about 7 minutes in all) and writes its log to OUT_DIR
# (default ./gpu-check), so one that fails or runs long leaves the others' figures:
#   env             the GPU, onnxruntime's version and providers, one CUDA session;
#   optimize        `graphopt optimize --provider CUDAExecutionProvider` on the examples at their
#                   bundled size: node seconds replayed on the device (graphopt/runtime/replay.py),
#                   plan, rewrite, verification, peaks; per example the outcome, the peak and step
#                   over the default session's, the time model's error on every plan measured, and
#                   the order check (where ONNX Runtime left the plan; the copies it inserted);
#   replay          the replayed node seconds against the CUDA profile's (launches, not kernels);
#   step            the built training graph's step on the CUDA provider against torch eager on
#                   the GPU: per-tap, whole-map and the forms measured on the GPU (train-graph
#                   --provider); gradients against float64 (benchmarks/step_vs_eager.py);
#   step-batch8     the same at 8x the batch;
#   peak            the peak graphopt measures on the GPU against the least memory limit that runs
#                   the step (benchmarks/peak_oracle.py);
#   optimize-large  `optimize` at 8x the examples' batch (--size large).
# Environment: EXAMPLES (default all six), LARGE (the examples of optimize-large and peak,
# default resnet,transformer), SKIP (parts not to run, e.g. "env optimize").
set -u
out=${1:-gpu-check}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
examples=${EXAMPLES:-mlp,resnet,densenet,unet,transformer,randwire}
large=${LARGE:-resnet,transformer}
skip=" ${SKIP:-} "
# PROVIDER: another provider for a trial of the script itself (e.g. CPUExecutionProvider, EXAMPLES=mlp)
cuda="--provider ${PROVIDER:-CUDAExecutionProvider}"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case "$skip" in *" $name "*) return ;; esac
    local started=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
}

part env 20 python3 - <<'EOF'
import subprocess, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
print("onnxruntime", ort.__version__, ort.get_device(), ort.get_available_providers())
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024])
model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
s = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
print("session providers", s.get_providers(), "max |MatMul - numpy| / max |numpy|",
      float(np.abs(s.run(None, {"x": a})[0] - a @ a).max() / np.abs(a @ a).max()))
EOF

part optimize 150 python3 "$here/optimize_time.py" $cuda --examples "$examples"
part replay 30 python3 "$here/replay_vs_profile.py" $cuda --examples resnet,transformer
part step 50 python3 "$here/step_vs_eager.py" $cuda --rounds 10 --examples "$examples"
part step-batch8 40 python3 "$here/step_vs_eager.py" $cuda --rounds 5 --batch-scale 8 --examples "$examples"
part peak 50 python3 "$here/peak_oracle.py" $cuda --examples "$large"
part optimize-large 60 python3 "$here/optimize_time.py" $cuda --size large --examples "$large"
