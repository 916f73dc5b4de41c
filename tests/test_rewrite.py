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
    with pytest.raises(ValueError) as refused:
        rewrite(training, graph, bad)
    assert str(refused.value) == (
        "the plan has 'bn' (copy 1) read 'bn.running_mean.copy' (copy 0) after 'bn' overwrote it in place "
        "(ONNX Runtime aliases an output to that input): the plan must recompute it")
    # a second copy of bn right after the first reads what the first copy overwrote
    schedule = list(plan.schedule)
    schedule.insert(schedule.index(("bn", 1)) + 1, ("bn", 2))
    with pytest.raises(ValueError, match=r"^the plan has 'bn' \(copy 2\) read 'bn.running_mean.copy' \(copy 1\) "
                                         r"after 'bn \(copy 1\)' overwrote it in place"):
        rewrite(training, graph, Plan("by-hand", plan.checkpoints, schedule))


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


def _function_ops_model(opset=17):
    """Relu -> HardSwish -> Neg -> LayerNormalization, with the HardSwish and LayerNormalization
    outputs as outputs. At opset 17 HardSwish is an ONNX function (HardSigmoid, Mul),
    LayerNormalization a context-dependent one (its body needs the input types) and Relu has
    none yet (its function is from opset 18)."""
    n = helper.make_node
    rng = np.random.default_rng(5)
    nodes = [n("Relu", ["x"], ["r"], name="relu"),
             n("HardSwish", ["r"], ["h"], name="hs"),
             n("Neg", ["h"], ["neg_h"], name="neg"),
             n("LayerNormalization", ["neg_h", "scale", "bias"], ["y"], name="ln", axis=-1, epsilon=1e-3)]
    graph = helper.make_graph(
        nodes, "function_ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [4, 6]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
        [numpy_helper.from_array(rng.uniform(0.5, 2, 6).astype(np.float32), "scale"),
         numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inputs = {"x": (rng.standard_normal((4, 6)) * 4).astype(np.float32)}
    return model, inputs


def _function_ops_reference(model, inputs):
    """numpy, from the operators' definitions: HardSwish(x) = x * max(0, min(1, x / 6 + 1/2)),
    LayerNormalization (z - mean) / sqrt(var + epsilon) * scale + bias over the last axis."""
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    x = inputs["x"].astype(np.float64)
    r = np.maximum(x, 0)
    h = r * np.clip(r / 6 + 0.5, 0, 1)
    z = -h
    y = (z - z.mean(1, keepdims=True)) / np.sqrt(z.var(1, keepdims=True) + 1e-3) * weights["scale"] + weights["bias"]
    return {"h": h, "y": y}


def _types(**shapes):
    return {name: helper.make_tensor_type_proto(elem, shape) for name, (elem, shape) in shapes.items()}


FUNCTION_TYPES = dict(neg_h=(TensorProto.FLOAT, [4, 6]), scale=(TensorProto.FLOAT, [6]), bias=(TensorProto.FLOAT, [6]))


def test_expanded_functions_are_their_bodies_in_place_and_compute_the_same():
    from graphopt.rewrite import expand_functions
    model, inputs = _function_ops_model()
    before = model.SerializeToString()
    expanded, names = expand_functions(model, ["hs", "ln", "relu"], _types(**FUNCTION_TYPES))
    assert model.SerializeToString() == before                     # the input untouched
    assert names == ["hs", "ln"]                                    # Relu has no body at opset 17
    order = [n.name for n in expanded.graph.node]
    ln_body = order[4:]
    assert order[:4] == ["relu", "hs/HardSigmoid_0", "hs/Mul_1", "neg"] and len(ln_body) > 10
    assert ln_body == [f"ln/{n.op_type}_{k}" for k, n in enumerate(expanded.graph.node[4:])]
    assert {n.op_type for n in expanded.graph.node}.isdisjoint({"HardSwish", "LayerNormalization"})
    assert [(o.domain, o.version) for o in expanded.opset_import] == [("", 17)]
    onnx.checker.check_model(expanded)
    expected = _function_ops_reference(model, inputs)
    for version in (model, expanded):
        session = ort.InferenceSession(version.SerializeToString(), providers=["CPUExecutionProvider"])
        got = dict(zip(["h", "y"], session.run(["h", "y"], inputs)))
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)


def test_a_function_without_its_input_types_or_its_body_is_left_as_it_is():
    from graphopt.rewrite import expand_functions
    model, _ = _function_ops_model()
    expanded, names = expand_functions(model, ["hs", "ln"])           # no types: ln stays
    assert names == ["hs"] and [n.op_type for n in expanded.graph.node][-1] == "LayerNormalization"
    types = dict(FUNCTION_TYPES)
    del types["bias"]
    expanded, names = expand_functions(model, ["ln"], _types(**types))   # the bias's type missing
    assert names == [] and expanded is model
    expanded, names = expand_functions(model, ["relu", "neg", "absent"])
    assert (expanded, names) == (model, [])
    model.graph.node[1].domain = "com.example"                      # not an ONNX operator
    assert expand_functions(model, ["hs"]) == (model, [])


def test_an_expanded_body_node_never_takes_a_name_in_use():
    from graphopt.rewrite import expand_functions
    model, _ = _function_ops_model()
    model.graph.node[2].name = "hs/HardSigmoid_0"
    expanded, _ = expand_functions(model, ["hs"])
    names = [n.name for n in expanded.graph.node]
    assert names[1:4] == ["hs/HardSigmoid_0_", "hs/Mul_1", "hs/HardSigmoid_0"] and len(set(names)) == len(names)


def test_the_model_opset_decides_which_body_and_whether_one():
    """A function's body is written in its own opset: taken only where each of its operators
    means at the model's opset what it meant there (GreaterOrEqual's body, opset 16, has an
    Equal, which changed at 19)."""
    from graphopt.rewrite import expand_functions, has_function
    n = helper.make_node
    for opset, kept in [(17, False), (19, True)]:
        graph = helper.make_graph(
            [n("GreaterOrEqual", ["a", "b"], ["c"], name="ge")], "ge",
            [helper.make_tensor_value_info(k, TensorProto.FLOAT, [3]) for k in "ab"],
            [helper.make_tensor_value_info("c", TensorProto.BOOL, [3])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        expanded, names = expand_functions(model, ["ge"])
        assert (names == []) == kept, opset
        if not kept:
            assert [x.op_type for x in expanded.graph.node] == ["Greater", "Equal", "Or"]
            a, b = np.array([1, 2, 3], np.float32), np.array([2, 2, 2], np.float32)
            session = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
            assert session.run(None, {"a": a, "b": b})[0].tolist() == [False, True, True]
    assert has_function(n("HardSwish", ["x"], ["y"]), 17) and not has_function(n("HardSwish", ["x"], ["y"]), 13)
    assert has_function(n("SoftmaxCrossEntropyLoss", ["x", "l"], ["y"]), 17)   # context-dependent
    assert not has_function(n("Relu", ["x"], ["y"]), 13) and has_function(n("Relu", ["x"], ["y"]), 18)
    assert not has_function(n("NoSuchOp", ["x"], ["y"]), 17)
    assert not has_function(n("Relu", ["x"], ["y"], domain="com.example"), 18)


def layernorm_training_graph(batch=16, width=32, renamed=None):
    """MatMul -> LayerNormalization (outputs y, mean, inv_std) -> Tanh -> loss, and a backward
    that reads y and inv_std, never the mean. `renamed`: tensor -> new name, applied throughout
    (to give tensors the names the rewrite's copies would take)."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.2).astype(np.float32), "W"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), "scale"),
             numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), "bias")]
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "W"], ["h"], name="mm"),
        n("LayerNormalization", ["h", "scale", "bias"], ["y", "mean", "inv_std"], name="ln", axis=-1),
        n("Tanh", ["y"], ["t"], name="tanh"),
        n("ReduceSum", ["t"], ["loss"], name="sum", keepdims=0),
        # backward
        n("Mul", ["t", "t"], ["tsq"], name="b_sq"),
        n("Mul", ["tsq", "inv_std"], ["g_scaled"], name="b_inv"),
        n("Mul", ["g_scaled", "y"], ["g_h"], name="b_y"),
        n("Transpose", ["x"], ["xt"], name="b_xt"),
        n("MatMul", ["xt", "g_h"], ["W_grad"], name="b_dw"),
    ]
    graph = helper.make_graph(
        nodes, "layernorm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [width, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": rng.standard_normal((batch, width)).astype(np.float32)}
    for old, new in (renamed or {}).items():
        for node in model.graph.node:
            node.input[:] = [new if t == old else t for t in node.input]
            node.output[:] = [new if t == old else t for t in node.output]
        for value in list(model.graph.input) + list(model.graph.initializer):
            if value.name == old:
                value.name = new
        if old in inputs:
            inputs[new] = inputs.pop(old)
    return model, inputs


def _check_runs_like_the_original(training, rewritten, inputs):
    onnx.checker.check_model(rewritten)
    produced = [t for node in rewritten.graph.node for t in node.output if t]
    resident = [i.name for i in rewritten.graph.input] + [i.name for i in rewritten.graph.initializer]
    assert len(set(produced)) == len(produced) and not set(produced) & set(resident)
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    comparison = compare_outputs(reference, run_outputs(rewritten, inputs))
    assert comparison.match, comparison.per_output


def test_unread_optional_outputs_are_dropped_in_originals_and_copies():
    """Nobody reads the mean, so neither the LayerNormalization nor its recomputed copy writes it;
    the copy's inv_std, read by the backward, stays (after the empty slot), renamed; the
    original's, read by no one once the copy's is, goes too. Every other output is read."""
    model, inputs = layernorm_training_graph()
    training, graph, plan, rewritten = planned(model, inputs)   # keep nothing optional
    assert graph.droppable == {"mean", "inv_std"} and ("ln", 1) in plan.schedule
    _check_unread_optional_outputs_dropped(training, rewritten, inputs)
    # the same with the mean's slot left empty in the given graph: inv_std, after it, is renamed
    model, inputs = layernorm_training_graph(renamed={"mean": ""})
    training, graph, plan, rewritten = planned(model, inputs)
    assert graph.droppable == {"inv_std"} and ("ln", 1) in plan.schedule
    _check_unread_optional_outputs_dropped(training, rewritten, inputs)


def _check_unread_optional_outputs_dropped(training, rewritten, inputs):
    nodes = {n.name: n for n in rewritten.graph.node}

    def written(name):
        outputs = list(nodes[name].output)
        while outputs and not outputs[-1]:
            outputs.pop()
        return outputs

    assert written("ln") == ["y"] and written("ln__rc1") == ["y__rc1", "", "inv_std__rc1"]
    read = {t for n in rewritten.graph.node for t in n.input} | {o.name for o in rewritten.graph.output}
    assert all(t in read for n in rewritten.graph.node for t in n.output if t)
    _check_runs_like_the_original(training, rewritten, inputs)


def test_copies_never_take_a_name_in_use():
    """Tensors already named as the copies would be, each met before the copy in the planned
    order or never (a backward output `h__rc1`, an unread graph input `y__rc1`, an unread
    initializer `inv_std__rc1`): the copies take other names, every tensor is written once and
    ORT computes what the original does."""
    from graphopt.rewrite import version_name
    model, inputs = layernorm_training_graph(renamed={"tsq": "h__rc1"})
    model.graph.input.append(helper.make_tensor_value_info("y__rc1", TensorProto.FLOAT, [2]))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "inv_std__rc1"))
    inputs["y__rc1"] = np.ones(2, np.float32)
    training, graph, plan, rewritten = planned(model, inputs)
    assert {("ln", 1), ("mm", 1)} <= set(plan.schedule)
    _check_runs_like_the_original(training, rewritten, inputs)
    assert version_name("t", 0, {"t"}) == "t" and version_name("t", -1, set()) == "t"
    assert version_name("t", 2, set()) == "t__rc2" and version_name("t", 2, {"t__rc2"}) == "t__rc2_"
    assert version_name("t", 2, {"t__rc2", "t__rc2_", "_"}) == "t__rc2__"


def test_the_plan_is_recorded_in_the_model():
    """`graphopt.plan`, once, even where the model had one: the strategy, the checkpoints and
    the number of recomputed nodes (counted here from the copies in the graph)."""
    import json

    from graphopt.rewrite import PLAN_KEY
    for older in (None, "an older plan"):
        model, inputs = layernorm_training_graph()
        if older:
            model.metadata_props.add(key=PLAN_KEY, value=older)
        training, graph, plan, rewritten = planned(model, inputs, checkpoints={"y"})
        records = [p.value for p in rewritten.metadata_props if p.key == PLAN_KEY]
        assert len(records) == 1, records
        assert json.loads(records[0]) == {"strategy": "test", "checkpoints": ["y"],
                                          "recompute_nodes": len(clones(rewritten))}
        assert clones(rewritten)


def test_the_default_domain_by_either_name_and_beside_others():
    """The model's opset is its default domain's, imported as "" or as "ai.onnx", whatever other
    domains it imports (at the newest opset HardSigmoid, in HardSwish's body, means something
    newer: not expanded there); a node written in domain "ai.onnx" is expanded as one in ""."""
    from graphopt.rewrite import expand_functions, has_function
    model, inputs = _function_ops_model()
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    assert expand_functions(model, ["hs"])[1] == ["hs"]
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("ai.onnx", 17))
    assert expand_functions(model, ["hs"])[1] == ["hs"]
    model, inputs = _function_ops_model()
    model.graph.node[1].domain = "ai.onnx"
    assert has_function(model.graph.node[1], 17)
    expanded, names = expand_functions(model, ["hs"])
    assert names == ["hs"] and [n.op_type for n in expanded.graph.node][1:3] == ["HardSigmoid", "Mul"]
    session = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["h"], inputs)[0], _function_ops_reference(model, inputs)["h"],
                               rtol=1e-5, atol=1e-6)


def test_a_function_from_the_models_own_opset_and_a_context_dependent_one():
    """Relu's function is from opset 18: at 18 it is expanded. SoftmaxCrossEntropyLoss's body is
    context-dependent: expanded with the input types (ORT computes numpy's mean cross-entropy
    from the body, at opsets 12 and 13), left without them."""
    from graphopt.rewrite import expand_functions
    model, inputs = _function_ops_model(18)
    expanded, names = expand_functions(model, ["relu"])
    assert names == ["relu"] and "Relu" not in {n.op_type for n in expanded.graph.node}
    session = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["h"], inputs)[0], _function_ops_reference(model, inputs)["h"],
                               rtol=1e-5, atol=1e-6)
    rng = np.random.default_rng(7)
    feeds = {"z": rng.standard_normal((5, 4)).astype(np.float32), "labels": rng.integers(0, 4, 5).astype(np.int64)}
    types = _types(z=(TensorProto.FLOAT, [5, 4]), labels=(TensorProto.INT64, [5]))
    z = feeds["z"].astype(np.float64)
    log_softmax = z - z.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    expected = -log_softmax[np.arange(5), feeds["labels"]].mean()
    for opset, given, expands in [(13, types, True), (13, None, False), (12, types, True)]:
        graph = helper.make_graph(
            [helper.make_node("SoftmaxCrossEntropyLoss", ["z", "labels"], ["loss"], name="sce")], "sce",
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, [5, 4]),
             helper.make_tensor_value_info("labels", TensorProto.INT64, [5])],
            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        expanded, names = expand_functions(model, ["sce"], given)
        assert names == (["sce"] if expands else []), (opset, given)
        if expands:
            assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in expanded.graph.node}
            session = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
            np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-5)
