"""The rewrite survives the runtime: clones are not merged back by CSE, random ops are
never recomputed, the planned order is the executed order, outputs are identical."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from graphopt.analyze import analyze
from graphopt.annotate import annotate
from graphopt.op_rules import build_cost_graph
from graphopt.examples import training_example
from graphopt.ingest import name_nodes
from graphopt.optimize import ORIGINAL_UNOPTIMIZED
from graphopt.rewrite import PLANNED_SETTINGS, rewrite
from graphopt.runtime.session import read_settings
from graphopt.search.plan import make_plan
from graphopt.verify import compare_outputs, run_outputs


def planned(model, inputs, checkpoints=()):
    name_nodes(model)
    training = analyze(model)
    ann = annotate(model, inputs, ORIGINAL_UNOPTIMIZED)
    graph = build_cost_graph(training, ann.tensor_bytes, ann.node_seconds)
    plan = make_plan(graph, "test", set(checkpoints))
    return training, graph, plan, rewrite(training, graph, plan)


def clones(model):
    return [n for n in model.graph.node if any(a.name == "__recompute_id" for a in n.attribute)]


def test_clones_survive_common_subexpression_elimination(tmp_path):
    model, inputs = training_example("mlp", small=True)
    _, _, plan, rewritten = planned(model, inputs)  # keep nothing optional: many clones
    assert plan.recompute_ops > 0 and len(clones(rewritten)) == plan.recompute_ops
    onnx.checker.check_model(rewritten)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # CSE on
    so.optimized_model_filepath = str(tmp_path / "basic.onnx")
    ort.InferenceSession(rewritten.SerializeToString(), so, providers=["CPUExecutionProvider"])
    after = onnx.load(tmp_path / "basic.onnx")
    recomputed = [n for n in after.graph.node if "__rc" in n.name]
    assert len(recomputed) == plan.recompute_ops


def test_rewritten_metadata_and_outputs():
    model, inputs = training_example("resnet", small=True)
    training, graph, plan, rewritten = planned(model, inputs)
    assert read_settings(rewritten) == PLANNED_SETTINGS
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    assert compare_outputs(reference, run_outputs(rewritten, inputs)).match


def dropout_training_graph(batch=64, width=128):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((width, width)) * 0.1).astype(np.float32), "W")
    consts = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "training"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one"),
              numpy_helper.from_array(np.array(2.0, np.float32), "inv_keep")]
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "W"], ["h"], name="mm"),
        n("Dropout", ["h", "ratio", "training"], ["d", "mask"], name="drop", seed=7),
        n("Tanh", ["d"], ["t"], name="tanh"),
        n("Tanh", ["t"], ["t2"], name="tanh2"),
        n("ReduceSum", ["t2"], ["loss"], name="sum", keepdims=0),
        # backward
        n("Mul", ["t2", "t2"], ["t2sq"], name="b_sq2"),
        n("Sub", ["one", "t2sq"], ["g_t"], name="b_g_t"),
        n("Mul", ["t", "t"], ["tsq"], name="b_sq"),
        n("Sub", ["one", "tsq"], ["dtanh"], name="b_dtanh"),
        n("Mul", ["g_t", "dtanh"], ["g_d"], name="b_g_d"),
        n("Cast", ["mask"], ["maskf"], name="b_cast", to=TensorProto.FLOAT),
        n("Mul", ["g_d", "maskf"], ["g_hm"], name="b_mask"),
        n("Mul", ["g_hm", "inv_keep"], ["g_h"], name="b_scale"),
        n("Transpose", ["x"], ["xt"], name="b_xt"),
        n("MatMul", ["xt", "g_h"], ["W_grad"], name="b_dw"),
    ]
    graph = helper.make_graph(
        nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [width, width])],
        [w] + consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": rng.standard_normal((batch, width)).astype(np.float32)}
    return model, inputs


def test_dropout_is_never_recomputed_and_its_mask_is_kept():
    model, inputs = dropout_training_graph()
    training, graph, plan, rewritten = planned(model, inputs)  # recompute everything allowed
    assert plan.recompute_ops > 0                     # tanh outputs are recomputed ...
    recomputed_ops = {n.op_type for n in clones(rewritten)}
    assert "Dropout" not in recomputed_ops            # ... but never the Dropout
    assert {"d", "mask"} <= graph.forced_checkpoints
    reads = {t for n in rewritten.graph.node for t in n.input}
    assert "mask" in reads and "d" in reads           # the original mask and output are read
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    assert compare_outputs(reference, run_outputs(rewritten, inputs)).match


def test_unused_optional_outputs_are_dropped_from_clones():
    model, inputs = training_example("transformer", small=True)
    _, graph, plan, rewritten = planned(model, inputs)
    read = {t for n in rewritten.graph.node for t in n.input} | {o.name for o in rewritten.graph.output}
    norms = [n for n in clones(rewritten) if n.op_type == "LayerNormalization"]
    assert norms
    for node in norms:
        assert len(node.output) == 1 or all(extra == "" or extra in read for extra in node.output[1:])
        if node.op_type == "LayerNormalization":
            for extra in node.output[1:]:
                assert extra == "" or extra in read


def batchnorm_training_graph(batch=8, channels=4, size=6, classes=3):
    """Conv -> BatchNormalization -> Relu -> Conv -> pool -> logits, in the form model zoos
    hold it (BatchNormalization in eval form), built into a training graph by graphopt's own
    builder: the node runs in training mode and reads copies of its running statistics."""
    from graphopt.builder.train_graph import build_training_graph
    rng = np.random.default_rng(3)
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f32(rng.standard_normal((channels, 3, 3, 3)) * 0.3), "w1"),
             numpy_helper.from_array(f32(rng.uniform(0.5, 1.5, channels)), "bn.weight"),
             numpy_helper.from_array(f32(rng.standard_normal(channels) * 0.1), "bn.bias"),
             numpy_helper.from_array(f32(rng.standard_normal(channels) * 0.5), "bn.running_mean"),
             numpy_helper.from_array(f32(rng.uniform(0.5, 2.0, channels)), "bn.running_var"),
             numpy_helper.from_array(f32(rng.standard_normal((channels, channels, 3, 3)) * 0.3), "w2"),
             numpy_helper.from_array(f32(rng.standard_normal((channels, classes)) * 0.3), "fc")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             n("BatchNormalization", ["c1", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
               ["b1"], name="bn", epsilon=1e-5, momentum=0.9),
             n("Relu", ["b1"], ["r1"], name="relu"),
             n("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             n("GlobalAveragePool", ["c2"], ["p"], name="pool"),
             n("Flatten", ["p"], ["f"], name="flatten"),
             n("MatMul", ["f", "fc"], ["logits"], name="fc")]
    graph = helper.make_graph(
        nodes, "conv_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": f32(rng.standard_normal((batch, 3, size, size))),
              "labels": rng.integers(0, classes, batch).astype(np.int64)}
    return build_training_graph(forward, loss="cross_entropy"), inputs


def test_recomputed_batchnorm_reads_fresh_statistics():
    """ONNX Runtime writes a training-mode BatchNormalization's updated running statistics into
    the buffers of its statistics inputs (its kernel aliases outputs 1, 2 to inputs 3, 4). A
    plan that kept those inputs for a recomputed clone made the clone start from the updated
    statistics (ResNet-50: layer3.5.bn1.running_var_updated off by 0.66). Asking to keep them
    is ignored: each run of the node, the clone included, reads its own fresh copy."""
    model, inputs = batchnorm_training_graph()
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    statistics = set(bn.input[3:5])
    training, graph, plan, rewritten = planned(model, inputs, checkpoints=statistics)
    assert graph.clobbered == statistics
    assert not plan.checkpoints & statistics
    recomputed = {op for op, copy in plan.schedule if copy}
    assert bn.name in recomputed                         # the clone runs ...
    assert {graph.ops[op].outputs[0] for op in recomputed} >= statistics  # ... on new copies
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    comparison = compare_outputs(reference, run_outputs(rewritten, inputs))
    assert comparison.match, comparison.per_output


def test_rewrite_refuses_a_plan_that_reads_an_overwritten_tensor():
    """A plan whose clone would read the statistics after the node overwrote them (made by hand
    here, bypassing `schedule_for`) is refused instead of silently computing from them."""
    import pytest

    from graphopt.search.plan import Plan
    model, inputs = batchnorm_training_graph()
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    training, graph, plan, _ = planned(model, inputs)
    producers = {graph.ops[op].outputs[0] for op, copy in plan.schedule if copy}
    assert set(bn.input[3:5]) <= producers
    # drop the clones of the statistics copies: the clone of bn reads the overwritten ones
    schedule = [(op, copy) for op, copy in plan.schedule
                if not (copy and graph.ops[op].outputs[0] in set(bn.input[3:5]))]
    bad = Plan("by-hand", plan.checkpoints, schedule)
    with pytest.raises(ValueError, match="overwrote it in place"):
        rewrite(training, graph, bad)


def _if_reading_outer_tensors():
    """A training graph whose backward has an If: its branches read `wt` (the transposed weight,
    made from an initializer) and `a_sum` (made from a forward activation) from the outer
    scope, taking neither as an input; `wt` is also read, later, by a gradient MatMul."""
    d = 32
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((d, d)).astype(np.float32), "w")
    then_branch = helper.make_graph([helper.make_node("Add", ["wt", "a_sum"], ["out_then"])], "then", [],
                                    [helper.make_tensor_value_info("out_then", TensorProto.FLOAT, [d, d])])
    else_branch = helper.make_graph([helper.make_node("Sub", ["wt", "a_sum"], ["out_else"])], "else", [],
                                    [helper.make_tensor_value_info("out_else", TensorProto.FLOAT, [d, d])])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0),
        # backward
        helper.make_node("Transpose", ["w"], ["wt"]),
        helper.make_node("ReduceSum", ["a"], ["a_sum"], keepdims=1),
        helper.make_node("If", ["flag"], ["probe"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["a", "a"], ["a2"]),
        helper.make_node("Sub", ["one", "a2"], ["gh"]),
        helper.make_node("MatMul", ["gh", "wt"], ["gx_unused"]),
        helper.make_node("Transpose", ["x"], ["xt"]),
        helper.make_node("MatMul", ["xt", "gh"], ["gw"]),
        helper.make_node("Add", ["gw", "gx_unused"], ["gw_probe"]),
    ]
    graph = helper.make_graph(
        nodes, "if_outer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [d, d]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("gw_probe", TensorProto.FLOAT, [d, d]),
         helper.make_tensor_value_info("probe", TensorProto.FLOAT, [d, d])],
        [w, numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": rng.standard_normal((d, d)).astype(np.float32), "flag": np.array(True)}
    return model, inputs


def test_tensors_a_subgraph_reads_from_the_outer_scope_are_its_inputs():
    """Read by an If's branches only, `wt` and `a_sum` must exist when the If runs: the cost
    graph counts them as the If's inputs (so the backward's reorder does not move `wt`'s
    Transpose past the If, to right before its explicit reader), and the tensors a body reads
    are never recomputed (a recomputed copy has another name). ORT runs the rewritten graph in
    the planned order, outputs identical."""
    from graphopt.analyze import implicit_inputs
    model, inputs = _if_reading_outer_tensors()
    onnx.checker.check_model(model)
    training, graph, plan, rewritten = planned(model, inputs, checkpoints=())
    if_name = next(n.name for n in model.graph.node if n.op_type == "If")
    assert implicit_inputs(training.nodes[if_name]) == ("wt", "a_sum")
    assert {"wt", "a_sum"} <= set(graph.ops[if_name].inputs)
    assert not graph.ops[graph.producer["a_sum"]].recomputable and not graph.ops[graph.producer["wt"]].recomputable
    order = [op for op, _ in plan.schedule]
    assert order.index(graph.producer["wt"]) < order.index(if_name)
    from graphopt.verify import executed_order
    reference = run_outputs(model, inputs, ORIGINAL_UNOPTIMIZED)
    assert compare_outputs(reference, run_outputs(rewritten, inputs, read_settings(rewritten))).match
    executed = executed_order(rewritten, inputs, PLANNED_SETTINGS)
    planned_names = [n.name for n in rewritten.graph.node]
    assert [n for n in executed if n in set(planned_names)] == planned_names
