"""The naming and bookkeeping rules of graphopt/rewrite.py that tests/test_rewrite.py does not
pin down: the names recomputed tensors get (never one the model already uses), the plan written
into the model's metadata, the refusal of a plan that reads an overwritten tensor (its message
names who read what after whom), and `expand_functions` against ONNX Runtime (the expanded model
computes what the original computes; body nodes are named as its docstring says). Both files are
what mutation testing runs against this module."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphopt.analyze import analyze  # noqa: E402
from graphopt.op_rules import build_cost_graph  # noqa: E402
from graphopt.rewrite import PLAN_KEY, expand_functions, has_function, rewrite, version_name  # noqa: E402
from graphopt.search.plan import Plan, make_plan  # noqa: E402
from graphopt.verify import compare_outputs, run_outputs  # noqa: E402
from graphopt.optimize import ORIGINAL_UNOPTIMIZED  # noqa: E402
from test_rewrite import batchnorm_training_graph, dropout_training_graph, planned  # noqa: E402


def test_version_names():
    assert version_name("t", 0, set()) == "t" and version_name("t", -1, {"t"}) == "t"
    assert version_name("t", 1, set()) == "t__rc1" and version_name("t", 2, {"t__rc1"}) == "t__rc2"
    assert version_name("t", 1, {"t__rc1"}) == "t__rc1_"
    assert version_name("t", 1, {"t__rc1", "t__rc1_"}) == "t__rc1__"


def _clones(model):
    return [n for n in model.graph.node if any(a.name == "__recompute_id" for a in n.attribute)]


def test_recomputed_tensors_never_take_a_name_the_model_uses():
    """The dropout graph with an initializer and a tensor of the source already named as the
    recomputed tanh outputs would be (t__rc1, t2__rc1): the clones write other names, and the
    rewritten model computes what the original does."""
    model, inputs = dropout_training_graph()
    for node in model.graph.node:      # the backward's t*t is called t2__rc1 in this source
        node.input[:] = ["t2__rc1" if t == "tsq" else t for t in node.input]
        node.output[:] = ["t2__rc1" if t == "tsq" else t for t in node.output]
    # an initializer no node reads (ONNX allows it)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "t__rc1"))
    training, graph, plan, rewritten = planned(model, inputs)
    written = [t for n in _clones(rewritten) for t in n.output]
    assert {"t__rc1_", "t2__rc1_"} <= set(written), written
    producers = [t for n in rewritten.graph.node for t in n.output if t]
    assert len(producers) == len(set(producers))
    assert not set(producers) & {i.name for i in rewritten.graph.initializer}
    onnx.checker.check_model(rewritten)
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    assert compare_outputs(reference, run_outputs(rewritten, inputs)).match


def _metadata(model) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for prop in model.metadata_props:
        found.setdefault(prop.key, []).append(prop.value)
    return found


def test_the_plan_is_written_into_the_metadata_once():
    model, inputs = dropout_training_graph()
    model.metadata_props.add(key=PLAN_KEY, value="a plan of an earlier rewrite")
    model.metadata_props.add(key="author", value="someone")
    training, graph, _, _ = planned(model, inputs)
    keep = {"t2", "t"} & set(graph.candidate_checkpoints)
    plan = make_plan(graph, "by-hand", keep)
    rewritten = rewrite(training, graph, plan)
    metadata = _metadata(rewritten)
    assert metadata["author"] == ["someone"] and len(metadata[PLAN_KEY]) == 1
    assert json.loads(metadata[PLAN_KEY][0]) == {"strategy": "by-hand", "checkpoints": sorted(keep),
                                                 "recompute_nodes": len(_clones(rewritten))}
    fresh, _ = dropout_training_graph()
    training, graph, plan, rewritten = planned(fresh, inputs)
    assert json.loads(_metadata(rewritten)[PLAN_KEY][0]) == {
        "strategy": "test", "checkpoints": [], "recompute_nodes": len(_clones(rewritten))}
    assert len(_clones(rewritten)) > 0


def test_the_refusal_of_a_read_after_an_overwrite_names_who_read_what_after_whom():
    model, inputs = batchnorm_training_graph()
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    training, graph, plan, _ = planned(model, inputs)
    statistics = set(bn.input[3:5])
    schedule = [(op, copy) for op, copy in plan.schedule if not (copy and graph.ops[op].outputs[0] in statistics)]
    with pytest.raises(ValueError) as refused:
        rewrite(training, graph, Plan("by-hand", plan.checkpoints, schedule))
    message = str(refused.value)
    first_read = next(t for t in bn.input[3:5])
    assert message == (f"the plan has {bn.name!r} (copy 1) read {first_read!r} (copy 0) after {bn.name!r} "
                       "overwrote it in place (ONNX Runtime aliases an output to that input): the plan must "
                       "recompute it")


# -- expand_functions ----------------------------------------------------------------------------
def _function_model():
    nodes = [helper.make_node("HardSwish", ["x"], ["h"], name="hs"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("HardSwish", ["r"], ["y"], name="hs2"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["y", "labels"], ["loss"], name="xent")]
    graph = helper.make_graph(nodes, "functions",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
                               helper.make_tensor_value_info("labels", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model):
    feeds = {"x": np.linspace(-4, 4, 12, dtype=np.float32).reshape(4, 3), "labels": np.array([0, 2, 1, 0])}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _layer_norm_model(opset: int = 17):
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], name="norm", epsilon=1e-5)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
              helper.make_tensor_value_info("scale", TensorProto.FLOAT, [3]),
              helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3])]
    graph = helper.make_graph([node], "norm", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), {v.name: v.type for v in inputs}


def test_a_context_dependent_function_is_expanded_with_its_input_types_only():
    """LayerNormalization-17's body depends on its input types: given them it is expanded, and
    ONNX Runtime computes the same normalization; without them, or missing one, it is left."""
    model, types = _layer_norm_model()
    expanded, names = expand_functions(model, ["norm"], types)
    assert names == ["norm"] and "LayerNormalization" not in {n.op_type for n in expanded.graph.node}
    assert all(n.name.startswith("norm/") for n in expanded.graph.node)
    feeds = {"x": np.linspace(-2, 3, 12, dtype=np.float32).reshape(4, 3),
             "scale": np.array([1.0, 2.0, 0.5], np.float32), "bias": np.array([0.0, 1.0, -1.0], np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(),  # noqa: E731
                                         providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(run(expanded), run(model), rtol=1e-5, atol=1e-6)
    assert expand_functions(model, ["norm"]) == (model, [])
    assert expand_functions(model, ["norm"], {k: v for k, v in types.items() if k != "bias"}) == (model, [])


def test_a_body_whose_operators_changed_meaning_is_not_expanded():
    """NegativeLogLikelihoodLoss's body is written at opset 13; its ReduceSum and ReduceMean take
    their axes as an input from opset 18 on: at 18 the body would mean something else, at 17 not."""
    node = helper.make_node("NegativeLogLikelihoodLoss", ["x", "labels"], ["loss"], name="nll")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, [4])]
    types = {v.name: v.type for v in inputs}
    for opset, expected in ((17, ["nll"]), (18, [])):
        graph = helper.make_graph([node], "nll", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        assert expand_functions(model, ["nll"], types)[1] == expected, opset


def test_has_function():
    model = _function_model()
    hard_swish = model.graph.node[0]
    assert has_function(hard_swish, 17)
    assert not has_function(hard_swish, 13)         # HardSwish is new in opset 14
    assert has_function(model.graph.node[3], 17)    # a context-dependent function
    assert not has_function(helper.make_node("MatMul", ["a", "b"], ["c"]), 17)
    assert not has_function(helper.make_node("Fancy", ["a"], ["b"], domain="com.example"), 17)
    # another domain's HardSwish is not ONNX's; "ai.onnx" is ONNX's default domain by its name
    assert not has_function(helper.make_node("HardSwish", ["a"], ["b"], domain="com.example"), 17)
    assert has_function(helper.make_node("HardSwish", ["a"], ["b"], domain="ai.onnx"), 17)


def test_expand_functions_writes_the_named_nodes_as_their_bodies_in_place():
    model = _function_model()
    expanded, names = expand_functions(model, ["hs", "hs2"])
    assert names == ["hs", "hs2"]
    assert [(n.name, n.op_type) for n in expanded.graph.node] == [
        ("hs/HardSigmoid_0", "HardSigmoid"), ("hs/Mul_1", "Mul"), ("relu", "Relu"),
        ("hs2/HardSigmoid_0", "HardSigmoid"), ("hs2/Mul_1", "Mul"), ("xent", "SoftmaxCrossEntropyLoss")]
    assert [n.output[0] for n in expanded.graph.node if n.name.endswith("Mul_1")] == ["h", "y"]
    assert [(o.domain, o.version) for o in expanded.opset_import] == [("", 17)] and not expanded.functions
    onnx.checker.check_model(expanded)
    for mine, theirs in zip(_run(expanded), _run(model)):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6)
    assert [n.name for n in model.graph.node] == ["hs", "relu", "hs2", "xent"]    # the input is untouched


def test_expand_functions_at_the_opset_a_function_was_defined_at():
    """HardSwish's body is defined at opset 14: a model of opset 14 gets it (and one of 13 has no
    HardSwish at all)."""
    model = _function_model()
    model.opset_import[0].version = 14
    del model.graph.node[3]
    del model.graph.output[0]
    expanded, names = expand_functions(model, ["hs", "hs2"])
    assert names == ["hs", "hs2"] and len(expanded.graph.node) == 5


def test_expand_functions_goes_on_after_a_node_it_cannot_expand():
    """Relu has an ONNX function, but not one of the model's opset's operators: it is left, and
    the HardSwish after it is still expanded."""
    model = _function_model()
    expanded, names = expand_functions(model, ["relu", "hs2"])
    assert names == ["hs2"] and [n.name for n in expanded.graph.node] == [
        "hs", "relu", "hs2/HardSigmoid_0", "hs2/Mul_1", "xent"]


def test_expand_functions_with_the_default_domain_named_or_not_imported():
    model = _function_model()
    model.graph.node[0].domain = "ai.onnx"
    model.opset_import.append(helper.make_opsetid("com.example", 1))    # after the default domain
    expanded, names = expand_functions(model, ["hs"])
    assert names == ["hs"] and [n.op_type for n in expanded.graph.node][:2] == ["HardSigmoid", "Mul"]
    # no default domain imported at all: onnx's newest opset
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    assert expand_functions(model, ["hs"])[1] == ["hs"]


def test_expand_functions_leaves_what_it_cannot_or_was_not_asked_to_expand():
    model = _function_model()
    # not named; and a context-dependent function without the input types: both as they were
    same, names = expand_functions(model, ["xent", "no such node"])
    assert names == [] and same is model
    expanded, names = expand_functions(model, ["hs2"])
    assert names == ["hs2"] and [n.name for n in expanded.graph.node] == [
        "hs", "relu", "hs2/HardSigmoid_0", "hs2/Mul_1", "xent"]


def test_expand_functions_names_never_clash_with_the_models_nodes():
    model = _function_model()
    model.graph.node[1].name = "hs/HardSigmoid_0"      # the Relu has the name the body would get
    expanded, _ = expand_functions(model, ["hs"])
    assert [n.name for n in expanded.graph.node][:3] == ["hs/HardSigmoid_0_", "hs/Mul_1", "hs/HardSigmoid_0"]


def test_expand_functions_reads_the_opset_of_the_default_domain():
    """A model that imports the default domain as "ai.onnx", beside another domain: the body is
    the one of the model's opset (17), not of the newest one onnx knows."""
    model = _function_model()
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("com.example", 1), helper.make_opsetid("ai.onnx", 17)])
    expanded, names = expand_functions(model, ["hs"])
    assert names == ["hs"] and [n.op_type for n in expanded.graph.node][:2] == ["HardSigmoid", "Mul"]
    assert {(o.domain, o.version) for o in expanded.opset_import} == {("com.example", 1), ("ai.onnx", 17)}


# -- optional outputs nobody reads ---------------------------------------------------------------
def _norm_and_pool_training_graph(norm_outputs=("n", "mean", "istd")):
    """MatMul -> LayerNormalization (its Mean and InvStdDev optional) -> Tanh -> MaxPool (its
    Indices optional) -> sum, built into a training graph by graphopt's builder."""
    from graphopt.builder.train_graph import build_training_graph
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), "W"),
               numpy_helper.from_array(np.ones(16, np.float32), "scale"),
               numpy_helper.from_array(np.zeros(16, np.float32), "bias"),
               numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("LayerNormalization", ["h", "scale", "bias"], list(norm_outputs), name="ln", axis=-1),
             helper.make_node("Tanh", ["n"], ["t"], name="tanh"),
             helper.make_node("Unsqueeze", ["t", "axes"], ["t3"], name="unsqueeze"),
             helper.make_node("MaxPool", ["t3"], ["p", "idx"], name="pool", kernel_shape=[2]),
             helper.make_node("ReduceSum", ["p"], ["loss"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "norm_pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], weights)
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return build_training_graph(forward, loss="output:loss"), {"x": rng.standard_normal((8, 16)).astype(np.float32)}


@pytest.mark.parametrize("norm_outputs", [("n", "mean", "istd"), ("n", "", "istd")], ids=["all named", "one left out"])
def test_optional_outputs_nobody_reads_are_dropped_from_originals_and_clones(norm_outputs):
    """ONNX Runtime never frees an output nobody reads: every optional output (after the first)
    that no node of the rewritten model reads is left out, trailing ones removed, in the nodes
    of the file and in their clones alike; the model still computes what the original does."""
    model, inputs = _norm_and_pool_training_graph(norm_outputs)
    training, graph, plan, rewritten = planned(model, inputs)     # nothing kept: ln, pool recomputed
    assert graph.droppable and plan.recompute_ops > 0
    read = {t for n in rewritten.graph.node for t in n.input} | {o.name for o in rewritten.graph.output}
    source = {n.name: n for n in model.graph.node}
    dropped = set()      # the nodes (originals and clones) that left a droppable output out
    for node in rewritten.graph.node:
        original = source[node.name.partition("__rc")[0]]
        assert not node.output or node.output[-1], (node.name, list(node.output))   # none trailing empty
        for k, name in enumerate(original.output):
            written = node.output[k] if k < len(node.output) else ""
            if name in graph.droppable:
                assert written == "" or written in read, (node.name, list(node.output))
                if written == "":
                    dropped.add(node.name)
            else:
                assert (written == "") == (name == ""), (node.name, list(node.output))
    assert {"ln", "ln__rc1", "pool"} <= dropped, dropped
    onnx.checker.check_model(rewritten)
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED)
    assert compare_outputs(reference, run_outputs(rewritten, inputs)).match
