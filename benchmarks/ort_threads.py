"""Which ONNX Runtime CPU kernels use the intra-op thread pool: one node alone, timed at one thread
and at `--threads` (issue 48). The builder's forms at two threads follow from this table (Gather
rather than Slice for a tap's rows, a product per image rather than one Gemm with a small
product, Adds rather than a Sum, a Pad of whole pixels rather than of map rows:
graphopt/builder/rules.py, graphopt/builder/lean.py); a new ONNX Runtime version may change it.

    python benchmarks/ort_threads.py [--threads 2] [--repeats 40]

Each case is one small ONNX graph in its own default session (one session alive at a time, so
that no other pool spins beside it), run back to back; the median of `--repeats` runs after one
warm-up. Prints a markdown table: milliseconds at one thread, at N, and their ratio (the
speed-up; 1.0: the kernel ran on one thread).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _ints(name: str, values) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _floats(name: str, values) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


def cases() -> dict:
    """name -> (nodes, {input: array}, initializers): what the builder writes, at the sizes of the
    examples' steps."""
    rng = np.random.default_rng(0)
    act = rng.standard_normal([16, 128, 32, 32]).astype(np.float32)
    other = rng.standard_normal(act.shape).astype(np.float32)
    last = rng.standard_normal([16, 34, 34, 64]).astype(np.float32)     # a padded source channels last
    rows = np.array([(1 + i) * 34 + 2 + j for i in range(32) for j in range(32)], np.int64)   # one tap's rows
    node = helper.make_node
    return {
        "Slice, one tap of a channels-last source": (
            [node("Slice", ["last", "s", "e", "a"], ["out"])], {"last": last},
            [_ints("s", [1, 2]), _ints("e", [33, 34]), _ints("a", [1, 2])]),
        "Gather, the same tap's rows": (
            [node("Reshape", ["last", "shape"], ["grid"]), node("Gather", ["grid", "rows"], ["out"], axis=1)],
            {"last": last}, [_ints("shape", [0, -1, 64]), _ints("rows", rows)]),
        "Slice, strided, channels first": (
            [node("Slice", ["x", "s", "e", "a", "st"], ["out"])], {"x": act},
            [_ints("s", [0, 0]), _ints("e", [32, 32]), _ints("a", [2, 3]), _ints("st", [2, 2])]),
        "Pad, [16, 128, 32, 32] by 1": (
            [node("Pad", ["x", "pads"], ["out"])], {"x": act}, [_ints("pads", [0, 0, 1, 1, 0, 0, 1, 1])]),
        "Pad, the same channels last, by 1": (
            [node("Pad", ["x", "pads"], ["out"])], {"x": np.ascontiguousarray(act.transpose(0, 2, 3, 1))},
            [_ints("pads", [0, 1, 1, 0, 0, 1, 1, 0])]),
        "Transpose to channels last": ([node("Transpose", ["x"], ["out"], perm=[0, 2, 3, 1])], {"x": act}, []),
        "Transpose, batch and channels swapped": (
            [node("Transpose", ["x"], ["out"], perm=[1, 0, 2, 3])], {"x": act}, []),
        "Sum of two": ([node("Sum", ["x", "y"], ["out"])], {"x": act, "y": other}, []),
        "Add": ([node("Add", ["x", "y"], ["out"])], {"x": act, "y": other}, []),
        "Sum of three": ([node("Sum", ["x", "y", "x"], ["out"])], {"x": act, "y": other}, []),
        "two Adds": ([node("Add", ["x", "y"], ["t"]), node("Add", ["t", "x"], ["out"])], {"x": act, "y": other}, []),
        "Greater, Cast, Mul (a Relu's mask)": (
            [node("Greater", ["x", "zero"], ["g"]), node("Cast", ["g"], ["c"], to=TensorProto.FLOAT),
             node("Mul", ["y", "c"], ["out"])], {"x": act, "y": other}, [_floats("zero", 0.0)]),
        "Where by a scalar (the same mask)": (
            [node("Greater", ["x", "zero"], ["g"]), node("Where", ["g", "y", "zero"], ["out"])],
            {"x": act, "y": other}, [_floats("zero", 0.0)]),
        "Gemm [32, K] @ [K, 32], K = 16 x 1024": (
            [node("Gemm", ["a", "b"], ["out"])],
            {"a": rng.standard_normal([32, 16 * 1024]).astype(np.float32),
             "b": rng.standard_normal([16 * 1024, 32]).astype(np.float32)}, []),
        "MatMul per image [16, 32, 1024] @ [16, 1024, 32], summed": (
            [node("MatMul", ["a", "b"], ["p"]), node("ReduceSum", ["p", "axis"], ["out"], keepdims=0)],
            {"a": rng.standard_normal([16, 32, 1024]).astype(np.float32),
             "b": rng.standard_normal([16, 1024, 32]).astype(np.float32)}, [_ints("axis", [0])]),
    }


def _session(nodes, feeds: dict, initializers, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        nodes, "case",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(nodes, feeds: dict, initializers, threads: int, repeats: int) -> float:
    session = _session(nodes, feeds, initializers, threads)
    session.run(None, feeds)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, feeds)
        seconds.append(time.perf_counter() - started)
    del session
    gc.collect()
    time.sleep(0.3)   # the pool's threads stop spinning before the next session's run
    return 1e3 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, CPU; medians of {args.repeats} runs of one node (or a few) alone")
    print(f"| case | one thread (ms) | {args.threads} threads (ms) | speed-up |")
    print("|---|---|---|---|")
    for name, (nodes, feeds, initializers) in cases().items():
        one = median_ms(nodes, feeds, initializers, 1, args.repeats)
        many = median_ms(nodes, feeds, initializers, args.threads, args.repeats)
        print(f"| {name} | {one:.3f} | {many:.3f} | {one / many:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
