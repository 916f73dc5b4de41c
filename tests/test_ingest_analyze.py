"""graphopt.ingest (load_model, external data, name_nodes) and graphopt.analyze on real
ONNX models built with onnx.helper: the forward/backward split of a real training graph,
and every way a model can fail to be a training graph, each with its typed error."""
import os
import shutil
import time
from collections import deque

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import ingest
from graphopt.analyze import analyze
from graphopt.errors import GraphoptError, InvalidModelError, LimitExceededError, UnsupportedOpError
from graphopt.examples import training_example

FLOAT = TensorProto.FLOAT
OPSET = [helper.make_opsetid("", 20)]


# ------------------------------------------------------------------ helpers --

def _model(nodes, inputs, outputs, initializers=(), opsets=OPSET):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=list(opsets))
    model.ir_version = 10
    return model


def _f(name, shape=None):
    return helper.make_tensor_value_info(name, FLOAT, shape)


def _weight():
    return numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 10, "W")


def _tiny_nodes():
    """loss = sum(x @ W); W_grad = x^T @ (-y): a structurally valid, runnable training graph."""
    return [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
        helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
        helper.make_node("Transpose", ["x"], ["xT"], name="xt"),
        helper.make_node("Neg", ["y"], ["gy"], name="gy"),
        helper.make_node("MatMul", ["xT", "gy"], ["W_grad"], name="gw"),
    ]


def _tiny(nodes=None, outputs=("loss", "W_grad"), extra_outputs=()):
    shapes = {"loss": [], "W_grad": [3, 2], "y": [2, 2]}
    outs = [_f(o, shapes.get(o)) for o in (*outputs, *extra_outputs)]
    return _model(_tiny_nodes() if nodes is None else nodes, [_f("x", [2, 3])], outs, [_weight()])


def _raises(exc_type, model, *words, **kwargs):
    with pytest.raises(exc_type) as info:
        analyze(model, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    return message


def _tensor_ancestor_nodes(model, tensor):
    """Names of the nodes `tensor` depends on (walking tensors, independent of analyze)."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    seen, todo = set(), deque([tensor])
    while todo:
        t = todo.popleft()
        node = producer.get(t)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        todo.extend(i for i in node.input if i)
    return seen


# ------------------------------------------------------------ analyze: real graph --

@pytest.fixture(scope="module")
def mlp_training():
    model, _ = training_example("mlp", small=True)
    return ingest.name_nodes(model)


def test_analyze_real_training_graph(mlp_training):
    model = mlp_training
    tg = analyze(model)
    nodes = {n.name: n for n in model.graph.node}
    order = [n.name for n in model.graph.node]
    outputs = [o.name for o in model.graph.output]
    assert tg.loss == outputs[0] == "loss"

    # forward = exactly the loss's ancestors (and the loss node), in file order
    assert set(tg.forward) == _tensor_ancestor_nodes(model, "loss")
    assert tg.forward == [n for n in order if n in set(tg.forward)]
    # backward = the other nodes that feed some output; non-empty, disjoint from forward
    needed = set().union(*(_tensor_ancestor_nodes(model, o) for o in outputs))
    assert tg.backward
    assert set(tg.backward) == needed - set(tg.forward)
    assert not set(tg.backward) & set(tg.forward)
    assert tg.backward == [n for n in order if n in set(tg.backward)]

    # stashed = forward tensors read by backward nodes
    forward_tensors = {t for n in tg.forward for t in nodes[n].output}
    read_by_backward = {t for n in tg.backward for t in nodes[n].input}
    assert tg.stashed
    assert set(tg.stashed) == forward_tensors & read_by_backward
    assert {"act0", "act3"} <= set(tg.stashed)  # the MLP's activations

    # parameters: floating initializers/inputs read by forward nodes; every <p>_grad's p is one
    assert tg.parameters
    grads = {o[: -len("_grad")] for o in outputs if o.endswith("_grad")}
    assert grads and grads <= set(tg.parameters)
    floating = {t.name for t in model.graph.initializer if t.data_type == FLOAT} | {"x"}
    forward_inputs = {t for n in tg.forward for t in nodes[n].input}
    assert set(tg.parameters) <= floating & forward_inputs
    assert "labels" not in tg.parameters  # int64 input
    assert tg.resident == frozenset({i.name for i in model.graph.input}
                                    | {i.name for i in model.graph.initializer})


def test_analyze_loss_option_picks_another_output(mlp_training):
    model = mlp_training
    tg = analyze(model, loss="fc0.weight_grad")
    assert tg.loss == "fc0.weight_grad"
    assert set(tg.forward) == _tensor_ancestor_nodes(model, "fc0.weight_grad")
    # the node computing `loss` itself is not an ancestor of fc0.weight_grad: backward now
    loss_node = next(n.name for n in model.graph.node if "loss" in n.output)
    assert loss_node in tg.backward and loss_node not in tg.forward


def test_analyze_loss_option_when_loss_is_not_first_output():
    model = _tiny(outputs=("W_grad", "loss"))
    tg = analyze(model, loss="loss")
    assert tg.loss == "loss"
    assert tg.forward == ["mm", "sum"]
    assert tg.backward == ["xt", "gy", "gw"]
    assert tg.stashed == ["y"]
    assert tg.parameters == ["W", "x"]


def test_analyze_tiny_graph_is_valid_onnx():
    model = _tiny()
    onnx.checker.check_model(model, full_check=True)
    tg = analyze(model)
    assert (tg.loss, tg.forward, tg.backward, tg.stashed) == ("loss", ["mm", "sum"],
                                                              ["xt", "gy", "gw"], ["y"])


def test_analyze_unknown_loss_name(mlp_training):
    _raises(InvalidModelError, mlp_training, "no_such_loss", "not a graph output",
            loss="no_such_loss")


# ------------------------------------------------------------ analyze: errors --

def test_error_cycle():
    nodes = [
        helper.make_node("Add", ["x", "q"], ["p"], name="n_add"),
        helper.make_node("Relu", ["p"], ["q"], name="n_relu"),
        helper.make_node("ReduceSum", ["p"], ["loss"], name="sum", keepdims=0),
        helper.make_node("Neg", ["q"], ["W_grad"], name="gw"),
    ]
    message = _raises(InvalidModelError, _tiny(nodes), "cycle")
    assert "n_add" in message and "n_relu" in message


def test_error_self_loop():
    nodes = _tiny_nodes() + [helper.make_node("Add", ["z", "x"], ["z"], name="selfie")]
    _raises(InvalidModelError, _tiny(nodes), "cycle", "selfie")


def test_error_tensor_nobody_produces():
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("Mul", ["y", "ghost_tensor"], ["gy"], name="gy")
    _raises(InvalidModelError, _tiny(nodes), "'ghost_tensor'", "'gy'")


def test_error_unknown_domain():
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("FancyNeg", ["y"], ["gy"], name="gy", domain="com.example.custom")
    model = _tiny(nodes)
    model.opset_import.append(helper.make_opsetid("com.example.custom", 1))
    message = _raises(UnsupportedOpError, model, "'FancyNeg'", "'com.example.custom'")
    assert "domain" in message


def test_known_domains_are_accepted():
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("Neg", ["y"], ["gy"], name="gy", domain="ai.onnx")
    assert analyze(_tiny(nodes)).backward == ["xt", "gy", "gw"]


def test_error_only_loss_output():
    model = _tiny(outputs=("loss",))
    _raises(InvalidModelError, model, "not a training graph", "only output is the loss")


def test_error_no_outputs():
    model = _tiny(outputs=())
    _raises(InvalidModelError, model, "no outputs")


def test_error_no_backward_node():
    # a second output that is a forward tensor: no node outside the loss's ancestors
    model = _tiny(nodes=_tiny_nodes()[:2], outputs=("loss", "y"))
    _raises(InvalidModelError, model, "not a training graph", "no backward")


def test_error_no_parameter_int_data_only():
    # the loss depends only on an int64 data input; the float initializer W only feeds backward
    nodes = [
        helper.make_node("Cast", ["labels"], ["c"], name="cast", to=FLOAT),
        helper.make_node("ReduceSum", ["c"], ["loss"], name="sum", keepdims=0),
        helper.make_node("Mul", ["c", "W"], ["W_grad"], name="gw"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("labels", TensorProto.INT64, [3, 2])],
                   [_f("loss"), _f("W_grad")], [_weight()])
    _raises(InvalidModelError, model, "not a training graph", "no parameter")


def test_error_no_parameter_constants_only():
    const = numpy_helper.from_array(np.ones((3, 2), np.float32), "k")
    nodes = [
        helper.make_node("Constant", [], ["k"], name="const", value=const),
        helper.make_node("ReduceSum", ["k"], ["loss"], name="sum", keepdims=0),
        helper.make_node("Mul", ["k", "W"], ["W_grad"], name="gw"),
    ]
    model = _model(nodes, [], [_f("loss"), _f("W_grad")], [_weight()])
    _raises(InvalidModelError, model, "no parameter")


def test_error_graph_output_nobody_produces():
    model = _tiny(extra_outputs=("phantom_grad",))
    _raises(InvalidModelError, model, "'phantom_grad'", "not produced")


def test_error_tensor_produced_twice():
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("Neg", ["y"], ["y"], name="again")
    _raises(InvalidModelError, _tiny(nodes), "'y'", "produced twice", "'mm'", "'again'")


def test_error_loss_not_computed_by_a_node():
    # the loss output is a graph input passed straight through
    model = _model(_tiny_nodes(), [_f("x", [2, 3]), _f("given_loss", [])],
                   [_f("given_loss"), _f("W_grad")], [_weight()])
    _raises(InvalidModelError, model, "'given_loss'", "not computed by any node")


def test_errors_are_graphopt_errors():
    assert issubclass(InvalidModelError, GraphoptError)
    assert issubclass(UnsupportedOpError, GraphoptError)
    assert issubclass(LimitExceededError, GraphoptError)


# ------------------------------------------------------------------ load_model --

def test_load_model_round_trip(tmp_path):
    model = _tiny()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    loaded = ingest.load_model(path)
    assert loaded.SerializeToString() == model.SerializeToString()
    assert ingest.load_model(str(path), max_bytes=path.stat().st_size).graph.name == "g"


def test_load_model_random_bytes(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(InvalidModelError, match="not a readable ONNX model"):
        ingest.load_model(path)


@pytest.mark.parametrize("data", [b"", b"\x08\x07", b"\x12\x04abcd"],
                         ids=["empty", "only-ir-version", "only-producer"])
def test_load_model_bytes_that_parse_but_have_no_graph(tmp_path, data):
    # protobuf accepts these (all fields optional); they are still not ONNX models
    path = tmp_path / "nograph.onnx"
    path.write_bytes(data)
    with pytest.raises(InvalidModelError, match="no graph"):
        ingest.load_model(path)
    with pytest.raises(InvalidModelError, match="no graph"):
        ingest.parse_model(data)


def test_load_model_text_file(tmp_path):
    path = tmp_path / "readme.onnx"
    path.write_text("this is not a model\n" * 10)
    with pytest.raises(InvalidModelError):
        ingest.load_model(path)


def test_load_model_missing_file(tmp_path):
    with pytest.raises(InvalidModelError, match="does not exist"):
        ingest.load_model(tmp_path / "nope.onnx")
    with pytest.raises(InvalidModelError, match="does not exist"):
        ingest.load_model(tmp_path)  # a folder is not a model file


def test_load_model_max_bytes(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_tiny(), str(path))
    size = path.stat().st_size
    with pytest.raises(LimitExceededError) as info:
        ingest.load_model(path, max_bytes=size - 1)
    assert str(size) in str(info.value) and str(size - 1) in str(info.value)


def _save_external(model, folder, name="m.onnx", location="weights.bin", **kwargs):
    """Save a copy of `model` (onnx.save_model rewrites the proto it saves) with external data."""
    path = folder / name
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0, **kwargs)
    return path


def _set_location(path, location, tensor="W"):
    """Rewrite the external-data location of `tensor` in the saved .onnx file at `path`."""
    model = onnx.load(str(path), load_external_data=False)
    init = next(t for t in model.graph.initializer if t.name == tensor)
    entry = next(e for e in init.external_data if e.key == "location")
    entry.value = location
    path.write_bytes(model.SerializeToString())  # the proto only: no external data rewritten


def test_load_model_external_data(tmp_path):
    model = _tiny()
    path = _save_external(model, tmp_path)
    on_disk = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in on_disk.graph.initializer)
    assert (tmp_path / "weights.bin").is_file()

    loaded = ingest.load_model(path)
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert got.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(got[name], original[name])
    assert analyze(loaded).parameters == ["W", "x"]


def test_load_model_external_data_in_subfolder(tmp_path):
    (tmp_path / "data").mkdir()
    path = _save_external(_tiny(), tmp_path, location="data/w.bin")
    loaded = ingest.load_model(path)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]),
                                  numpy_helper.to_array(_weight()))


def test_external_data_outside_folder(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = _save_external(_tiny(), model_dir)
    # a real file outside the model's folder, with the same bytes
    (tmp_path / "outside.bin").write_bytes((model_dir / "weights.bin").read_bytes())
    for location in ("../outside.bin", "sub/../../outside.bin"):
        _set_location(path, location)
        with pytest.raises(InvalidModelError) as info:
            ingest.load_model(path)
        assert "outside" in str(info.value) and location in str(info.value)


def test_external_data_absolute_path(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = _save_external(_tiny(), model_dir)
    absolute = str((model_dir / "weights.bin").resolve())  # exists, and even inside the folder
    _set_location(path, absolute)
    with pytest.raises(InvalidModelError, match="absolute"):
        ingest.load_model(path)


def test_external_data_symlink_out_of_folder(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = _save_external(_tiny(), model_dir)
    (tmp_path / "outside.bin").write_bytes((model_dir / "weights.bin").read_bytes())
    (model_dir / "link.bin").symlink_to(tmp_path / "outside.bin")
    _set_location(path, "link.bin")
    with pytest.raises(InvalidModelError, match="outside"):
        ingest.load_model(path)


def test_external_data_missing_file(tmp_path):
    path = _save_external(_tiny(), tmp_path)
    _set_location(path, "missing.bin")
    with pytest.raises(InvalidModelError, match="missing.bin"):
        ingest.load_model(path)
    # the file named by the model deleted after saving
    path2 = _save_external(_tiny(), tmp_path, name="m2.onnx", location="w2.bin")
    (tmp_path / "w2.bin").unlink()
    with pytest.raises(InvalidModelError, match="w2.bin"):
        ingest.load_model(path2)


def test_external_data_truncated_file(tmp_path):
    path = _save_external(_tiny(), tmp_path)
    with open(tmp_path / "weights.bin", "r+b") as f:
        f.truncate(8)  # W needs 24 bytes
    with pytest.raises(InvalidModelError, match="external data"):
        ingest.load_model(path)


def test_external_data_in_constant_node_attribute(tmp_path):
    # Constant-node tensors can be external too: they are confined the same way
    const = numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "k")
    nodes = _tiny_nodes() + [helper.make_node("Constant", [], ["k"], name="const", value=const),
                             helper.make_node("Add", ["W_grad", "k"], ["W_grad2"], name="add")]
    path = _save_external(_tiny(nodes, extra_outputs=("W_grad2",)), tmp_path,
                          convert_attribute=True)
    loaded = ingest.load_model(path)
    value = next(n for n in loaded.graph.node if n.name == "const").attribute[0].t
    np.testing.assert_array_equal(numpy_helper.to_array(value), np.full((3, 2), 0.5, np.float32))

    model = onnx.load(str(path), load_external_data=False)
    tensor = next(n for n in model.graph.node if n.name == "const").attribute[0].t
    assert tensor.data_location == TensorProto.EXTERNAL
    next(e for e in tensor.external_data if e.key == "location").value = "../outside.bin"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModelError, match="outside"):
        ingest.load_model(path)


# ------------------------------------------------------------- > 2 GB of weights --

@pytest.mark.slow
def test_load_model_over_2gb_external(tmp_path):
    """Weights over protobuf's 2 GB limit load through external data (3 x 720 MB tensors).

    About 13 s and 3.8 GB peak RSS on a 2-core machine; needs 2.2 GB of free disk.
    Deselect with `-m "not slow"` or GRAPHOPT_SLOW=0."""
    if os.environ.get("GRAPHOPT_SLOW") == "0":
        pytest.skip("GRAPHOPT_SLOW=0")
    if shutil.disk_usage(tmp_path).free < 4 * 2**30:
        pytest.skip("needs 2.2 GB of free disk under the pytest tmp folder")
    try:
        _check_over_2gb(tmp_path)
    finally:  # pytest keeps recent tmp folders: do not leave 2 GB behind
        for leftover in tmp_path.glob("*"):
            leftover.unlink()


def _check_over_2gb(tmp_path):
    n = 180 * 2**20                      # float32 elements per tensor: 720 MiB
    chunk = np.arange(2**22, dtype=np.float32)  # 16 MiB pattern
    names = ["big0", "big1", "big2"]
    inits = []
    with open(tmp_path / "weights.bin", "wb") as f:
        for k, name in enumerate(names):
            offset = f.tell()
            for _ in range(n // chunk.size):
                f.write((chunk + k).tobytes())
            tensor = TensorProto(name=name, data_type=FLOAT, dims=[n])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "weights.bin"), ("offset", str(offset)),
                               ("length", str(n * 4))):
                tensor.external_data.add(key=key, value=value)
            inits.append(tensor)
    assert (tmp_path / "weights.bin").stat().st_size > 2**31

    nodes = [helper.make_node("ReduceSum", [name], ["s%d" % k], name="sum%d" % k, keepdims=0)
             for k, name in enumerate(names)]
    nodes += [helper.make_node("Sum", ["s0", "s1", "s2"], ["loss"], name="loss_sum"),
              helper.make_node("Neg", ["s0"], ["big0_grad"], name="g0")]
    model = _model(nodes, [], [_f("loss"), _f("big0_grad")], inits)
    path = tmp_path / "big.onnx"
    path.write_bytes(model.SerializeToString())

    start = time.perf_counter()
    loaded = ingest.load_model(path)
    elapsed = time.perf_counter() - start
    total = 0
    for k, tensor in enumerate(loaded.graph.initializer):
        assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data
        values = np.frombuffer(tensor.raw_data, dtype=np.float32)
        assert values.size == n
        total += values.nbytes
        assert values[0] == k and values[chunk.size - 1] == chunk.size - 1 + k
        assert values[-1] == chunk.size - 1 + k and values[22 * chunk.size] == k
    assert total > 2**31
    tg = analyze(loaded)
    assert tg.parameters == names
    print(f"loaded {total / 2**30:.2f} GiB of external weights in {elapsed:.1f} s")


# ------------------------------------------------------------------ name_nodes --

def test_name_nodes_empty_and_duplicate_names():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"], name=""),
        helper.make_node("ReduceSum", ["y"], ["loss"], name="dup", keepdims=0),
        helper.make_node("Transpose", ["x"], ["xT"], name="dup"),
        helper.make_node("Neg", ["y"], ["gy"], name=""),
        helper.make_node("MatMul", ["xT", "gy"], ["W_grad"], name="dup"),
        helper.make_node("Identity", ["W_grad"], ["W_grad2"], name="dup_0"),
        helper.make_node("Identity", ["W_grad2"], ["W_grad3"], name="MatMul_0"),
    ]
    model = _tiny(nodes, extra_outputs=("W_grad2", "W_grad3"))
    before = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert ingest.name_nodes(model) is model
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names), names
    assert names[1] == "dup"            # the first holder of a name keeps it
    assert names[2].startswith("dup") and names[4].startswith("dup")
    assert names[0].startswith("MatMul") and names[3].startswith("Neg")
    # only names change
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == before
    # and the model now analyzes (node names are its keys)
    tg = analyze(model)
    assert len(tg.forward) + len(tg.backward) == len(names)


def test_name_nodes_keeps_unique_names_and_is_idempotent():
    model = _tiny()
    names = [n.name for n in model.graph.node]
    ingest.name_nodes(model)
    assert [n.name for n in model.graph.node] == names
    many = _model([helper.make_node("Relu", ["x" if i == 0 else "r%d" % (i - 1)], ["r%d" % i])
                   for i in range(50)], [_f("x", [2])], [_f("r49")])
    ingest.name_nodes(many)
    first = [n.name for n in many.graph.node]
    assert len(set(first)) == 50 and all(first)
    ingest.name_nodes(many)
    assert [n.name for n in many.graph.node] == first


def test_name_nodes_on_training_example():
    model, _ = training_example("mlp", small=True)
    for node in model.graph.node[::3]:
        node.name = ""
    for node in model.graph.node[1::3]:
        node.name = "same"
    ingest.name_nodes(model)
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert analyze(model).backward


def test_a_graph_with_operators_this_runtime_lacks_is_unsupported():
    # what a training artifact of the deprecated onnxruntime-training looks like to a stock wheel
    import numpy as np
    from onnx import helper, numpy_helper

    from graphopt.errors import UnsupportedOpError
    from graphopt.optimize import OptimizeOptions, optimize
    w = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"], name="mul"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
             helper.make_node("SoftmaxCrossEntropyLossGrad", ["loss", "y", "x"], ["w_grad"], name="grad",
                              domain="com.microsoft")]
    graph = helper.make_graph(nodes, "artifact", [helper.make_tensor_value_info("x", 1, [4])],
                              [helper.make_tensor_value_info("loss", 1, []),
                               helper.make_tensor_value_info("w_grad", 1, [4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(UnsupportedOpError, match="SoftmaxCrossEntropyLossGrad.*train-graph"):
        optimize(model, OptimizeOptions(measure=False))


def test_implicit_inputs_of_nested_subgraphs():
    """Outer tensors a body reads: by its nodes, by a nested body, or passed out as its output;
    not its own inputs, initializers or what it computes; each once."""
    from onnx import TensorProto, helper
    from graphopt.analyze import implicit_inputs
    f = TensorProto.FLOAT
    inner = helper.make_graph([helper.make_node("Mul", ["u", "local"], ["v"])], "inner", [],
                              [helper.make_tensor_value_info("v", f, [1])])
    then_branch = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["local"]),
         helper.make_node("If", ["c"], ["w"], then_branch=inner, else_branch=inner),
         helper.make_node("Add", ["w", "a"], ["out"])],
        "then", [], [helper.make_tensor_value_info("out", f, [1])])
    else_branch = helper.make_graph([], "else", [], [helper.make_tensor_value_info("b", f, [1])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)
    found = implicit_inputs(node)
    assert sorted(found) == ["a", "b", "u"] and len(found) == 3
