"""The fused optimizer step (graphopt/builder/optimizer.py) on its own: a training graph made by
hand whose gradients are its inputs, so each step's gradient is chosen here; the fused graph
runs in ONNX Runtime for a few steps (each step's ``<name>_updated`` fed back as ``<name>``) and
every updated parameter and state equals a float64 reference written from torch's formulas
(torch.optim.SGD and AdamW, decoupled weight decay) in numpy, step by step. Fast (no torch, no
model export): the mutation selection of the optimizer (tests/mutation.py)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.builder.optimizer import METADATA_KEY, STEP_NAME, OptimizerSpec, chunk_rows, fuse_optimizer
from graphopt.errors import InvalidModelError, InvalidOptionError

SHAPES = {"w": (3, 4), "b": (4,)}
STEPS = 4


def _training_graph(dtype=np.float32, with_statistic=True):
    """Outputs ``loss``, ``w_grad``, ``b_grad`` (the inputs ``gw``, ``gb`` passed through, made
    by nodes 1 and 3 of 5), then two extras: ``stat_updated`` (a running statistic's update, as
    a BatchNormalization's: ``stat`` is an initializer the graph does not take as an input) and
    ``stat.negated`` (an extra output that is no update, though as long as one)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(dtype), p) for p, s in SHAPES.items()]
    inits.append(numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "stat"))
    n = helper.make_node
    nodes = [n("ReduceSum", ["x"], ["loss"], name="loss_sum", keepdims=0),
             n("Identity", ["gw"], ["w_grad"], name="w_grad_node"),
             n("Neg", ["x"], ["stat.negated"], name="between"),
             n("Identity", ["gb"], ["b_grad"], name="b_grad_node"),
             n("Add", ["stat", "stat"], ["stat_updated"], name="stat_node")]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
               helper.make_tensor_value_info("w_grad", elem, list(SHAPES["w"])),
               helper.make_tensor_value_info("b_grad", elem, list(SHAPES["b"]))]
    if with_statistic:
        outputs.append(helper.make_tensor_value_info("stat_updated", TensorProto.FLOAT, [2]))
    else:
        nodes.pop()
    outputs.append(helper.make_tensor_value_info("stat.negated", TensorProto.FLOAT, [5]))
    graph = helper.make_graph(
        nodes, "by_hand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5]),
         helper.make_tensor_value_info("gw", elem, list(SHAPES["w"])),
         helper.make_tensor_value_info("gb", elem, list(SHAPES["b"]))],
        outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _gradients(dtype=np.float32):
    """STEPS gradients per parameter, of mixed signs and sizes (some small beside eps)."""
    rng = np.random.default_rng(1)
    return [{p: (rng.standard_normal(s) * rng.choice([0.01, 1.0, 3.0], size=s)).astype(dtype)
             for p, s in SHAPES.items()} for _ in range(STEPS)]


def _one_thread() -> ort.SessionOptions:
    """One thread, no spinning: tiny graphs, and mutation testing limits each run's CPU seconds."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _run_fused(spec, dtype=np.float32, chunks=None):
    """The fused graph run STEPS times in ONNX Runtime: per step, name -> value after it."""
    model = _training_graph(dtype)
    fuse_optimizer(model, list(SHAPES), spec, chunks)
    onnx.checker.check_model(model)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = [i.name for i in model.graph.input]
    session = ort.InferenceSession(model.SerializeToString(), _one_thread(), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    state = {k: values[k] for k in names if k in values}
    history = []
    for gradient in _gradients(dtype):
        feeds = dict(state, x=np.arange(5, dtype=np.float32), gw=gradient["w"], gb=gradient["b"])
        got = dict(zip(outputs, session.run(None, {k: feeds[k] for k in names})))
        for name, value in got.items():
            if name.endswith("_updated"):
                state[name[:-len("_updated")]] = value
        history.append(got)
    return model, values, history


def _reference(spec_kind, start, lr, momentum=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8):
    """torch's update rules in float64 (torch/optim/sgd.py, adam.py with decoupled decay):
    per step, name -> value after it."""
    p = {k: start[k].astype(np.float64) for k in SHAPES}
    buf = {k: np.zeros(SHAPES[k]) for k in SHAPES}
    m = {k: np.zeros(SHAPES[k]) for k in SHAPES}
    v = {k: np.zeros(SHAPES[k]) for k in SHAPES}
    history = []
    for t, gradient in enumerate(_gradients(), start=1):
        after = {}
        for k in SHAPES:
            g = gradient[k].astype(np.float64)
            if spec_kind == "sgd":
                d = g + weight_decay * p[k]
                if momentum:
                    buf[k] = momentum * buf[k] + d
                    d = buf[k]
                    after[f"{k}.momentum_buffer_updated"] = buf[k]
                p[k] = p[k] - lr * d
            else:
                b1, b2 = betas
                p[k] = p[k] * (1 - lr * weight_decay)
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                denom = np.sqrt(v[k]) / np.sqrt(1 - b2 ** t) + eps
                p[k] = p[k] - lr / (1 - b1 ** t) * m[k] / denom
                after[f"{k}.exp_avg_updated"], after[f"{k}.exp_avg_sq_updated"] = m[k], v[k]
            after[f"{k}_updated"] = p[k]
        if spec_kind == "adamw":
            after[STEP_NAME + "_updated"] = np.float64(t)
        history.append({k: np.copy(x) for k, x in after.items()})
    return history


def _assert_steps_equal(got, expected):
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        for name, value in e.items():
            assert name in g, (step, name, sorted(g))
            np.testing.assert_allclose(g[name], value, rtol=2e-5, atol=1e-6, err_msg=f"step {step}: {name}")


SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "decay": dict(lr=0.2, weight_decay=0.3),
    "momentum-decay": dict(lr=0.07, momentum=0.6, weight_decay=0.25),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_fused_sgd_steps_equal_the_float64_reference(case):
    kwargs = SGD_CASES[case]
    model, start, got = _run_fused(OptimizerSpec("sgd", **kwargs))
    _assert_steps_equal(got, _reference("sgd", start, **kwargs))
    outputs = [o.name for o in model.graph.output]
    state = ["w.momentum_buffer_updated", "b.momentum_buffer_updated"] if kwargs.get("momentum") else []
    assert outputs == ["loss", "w_updated", "b_updated"] + state + ["stat_updated", "stat.negated"]
    if kwargs.get("momentum"):
        assert all(not np.any(start[s]) for s in ("w.momentum_buffer", "b.momentum_buffer"))


ADAMW_CASES = {
    # eps 0.05 beside gradients of 0.01: eps moves the step; betas far from their defaults
    "explicit": dict(lr=0.3, betas=(0.7, 0.8), eps=0.05, weight_decay=0.2),
    "no-decay": dict(lr=0.1, betas=(0.6, 0.95), eps=0.02, weight_decay=0.0),
}


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_fused_adamw_steps_equal_the_float64_reference(case):
    kwargs = ADAMW_CASES[case]
    model, start, got = _run_fused(OptimizerSpec("adamw", **kwargs))
    _assert_steps_equal(got, _reference("adamw", start, **kwargs))
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["loss", "w_updated", "b_updated", "w.exp_avg_updated", "w.exp_avg_sq_updated",
                       "b.exp_avg_updated", "b.exp_avg_sq_updated", STEP_NAME + "_updated", "stat_updated",
                       "stat.negated"]
    assert float(start[STEP_NAME]) == 0.0 and start[STEP_NAME].dtype == np.float32
    assert all(not np.any(start[f"{p}.{s}"]) for p in SHAPES for s in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("chunks", [{"w": 3, "b": 2}, {"w": 2}, {"b": 4, "w": 7}])
def test_adamw_moments_made_in_blocks_of_rows_are_the_same_bits(chunks):
    """The moments of a parameter made block by block (Slice, the same arithmetic, Concat) equal
    the float64 reference, and bit for bit the moments made whole: the same operations on the
    same elements."""
    kwargs = ADAMW_CASES["explicit"]
    model, start, got = _run_fused(OptimizerSpec("adamw", **kwargs), chunks=chunks)
    _assert_steps_equal(got, _reference("adamw", start, **kwargs))
    _, _, whole = _run_fused(OptimizerSpec("adamw", **kwargs))
    for step, (a, b) in enumerate(zip(got, whole)):
        assert sorted(a) == sorted(b)
        for name in a:
            assert np.array_equal(a[name], b[name]), (step, name)
    concats = [n for n in model.graph.node if n.op_type == "Concat"]
    slices = [n for n in model.graph.node if n.op_type == "Slice"]
    pieces = {p: min(k, SHAPES[p][0]) for p, k in chunks.items()}
    # per blocked parameter: exp_avg and exp_avg_sq joined; a gradient and a state block read per block, twice
    assert sorted(o for n in concats for o in n.output) == sorted(
        f"{p}.{s}_updated" for p in pieces for s in ("exp_avg", "exp_avg_sq"))
    assert len(slices) == sum(4 * k for k in pieces.values())
    assert all(len(n.input) == pieces[n.output[0].split(".")[0]] for n in concats)


def test_blocks_of_rows_cover_the_rows_once_as_evenly_as_can_be():
    for rows in (1, 2, 5, 7, 64, 1000):
        for pieces in (1, 2, 3, 8, 2000):
            blocks = chunk_rows(rows, pieces)
            if min(pieces, rows) == 1:
                assert blocks == [None]
                continue
            assert len(blocks) == min(pieces, rows)
            assert blocks[0][0] == 0 and blocks[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
            sizes = [end - start for start, end in blocks]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_the_defaults_are_torchs():
    """Unset, weight decay is torch's default for the kind (AdamW 0.01, SGD 0) and so are
    AdamW's betas (0.9, 0.999) and eps (1e-8)."""
    _, start, got = _run_fused(OptimizerSpec("adamw", lr=0.5))
    _assert_steps_equal(got, _reference("adamw", start, lr=0.5, weight_decay=0.01))
    _, start, got = _run_fused(OptimizerSpec("sgd", lr=0.5))
    _assert_steps_equal(got, _reference("sgd", start, lr=0.5))
    assert OptimizerSpec("adamw", lr=1).decay == 0.01 and OptimizerSpec("sgd", lr=1).decay == 0.0
    assert OptimizerSpec("adamw", lr=1, weight_decay=0).decay == 0.0


def test_sgd_keeps_a_float64_parameter_in_float64():
    model, start, got = _run_fused(OptimizerSpec("sgd", lr=0.1, momentum=0.5, weight_decay=0.2), dtype=np.float64)
    assert got[-1]["w_updated"].dtype == np.float64 and start["w.momentum_buffer"].dtype == np.float64
    _assert_steps_equal(got, _reference("sgd", start, lr=0.1, momentum=0.5, weight_decay=0.2))
    with pytest.raises(InvalidModelError, match="'w' is not float32"):
        fuse_optimizer(_training_graph(np.float64), list(SHAPES), OptimizerSpec("adamw", lr=0.1))


def test_parameters_state_and_statistics_become_inputs_with_their_initializers():
    model = _training_graph()
    fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1, momentum=0.9))
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == ["x", "gw", "gb", "w", "w.momentum_buffer", "b", "b.momentum_buffer", "stat"]
    shapes = {k: [d.dim_value for d in v.type.tensor_type.shape.dim] for k, v in inputs.items()}
    assert shapes["w"] == shapes["w.momentum_buffer"] == [3, 4] and shapes["stat"] == [2]
    # without a statistic's update among the outputs, the statistic stays a constant
    model = _training_graph(with_statistic=False)
    fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1))
    assert [i.name for i in model.graph.input] == ["x", "gw", "gb", "w", "b"]


def test_each_update_follows_the_node_that_completes_its_gradient():
    model = _training_graph()
    written = fuse_optimizer(model, list(SHAPES), OptimizerSpec("adamw", lr=0.1))
    order = [n.name for n in model.graph.node]
    assert all(order) and len(set(order)) == len(order)    # the orders graphopt writes name the nodes
    assert order[:len(written.head)] == written.head and len(written.head) == 11
    assert set(written.after) == {"w_grad_node", "b_grad_node"}
    for grad_node, param in [("w_grad_node", "w"), ("b_grad_node", "b")]:
        chain = written.after[grad_node]
        at = order.index(grad_node)
        assert order[at + 1:at + 1 + len(chain)] == chain
        updates = {o for n in model.graph.node if n.name in chain for o in n.output}
        assert f"{param}_updated" in updates and f"{param}.exp_avg_updated" in updates
    assert order.index("between") == order.index(written.after["w_grad_node"][-1]) + 1


def test_the_hyper_parameters_are_written_into_the_model():
    def written(spec):
        model = _training_graph()
        model.metadata_props.add(key="given", value="kept")
        fuse_optimizer(model, list(SHAPES), spec)
        props = {p.key: p.value for p in model.metadata_props}
        assert props["given"] == "kept" and len(props) == len(model.metadata_props) == 2
        return dict(part.split("=") for part in props[METADATA_KEY].split(";"))

    assert written(OptimizerSpec("sgd", lr=0.25, momentum=0.5)) == {
        "kind": "sgd", "lr": "0.25", "weight_decay": "0.0", "momentum": "0.5"}
    assert written(OptimizerSpec("adamw", lr=0.125, betas=(0.5, 0.75), eps=1e-3)) == {
        "kind": "adamw", "lr": "0.125", "weight_decay": "0.01", "betas": "0.5,0.75", "eps": "0.001"}


REFUSALS = [
    (OptimizerSpec("adam", lr=1), "unknown optimizer 'adam': use one of sgd, adamw"),
    (OptimizerSpec("sgd", lr=0), "learning rate must be a positive number, got 0"),
    (OptimizerSpec("sgd", lr=-1), "learning rate must be a positive number"),
    (OptimizerSpec("sgd", lr=float("inf")), "learning rate must be a positive number"),
    (OptimizerSpec("sgd", lr=float("nan")), "learning rate must be a positive number"),
    (OptimizerSpec("sgd", lr=1, weight_decay=-0.5), r"weight decay must be >= 0, got -0.5"),
    (OptimizerSpec("adamw", lr=1, weight_decay=float("nan")), "weight decay must be >= 0"),
    (OptimizerSpec("sgd", lr=1, momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
    (OptimizerSpec("sgd", lr=1, momentum=-0.1), "momentum must be in"),
    (OptimizerSpec("sgd", lr=1, momentum=float("nan")), "momentum must be in"),
    (OptimizerSpec("adamw", lr=1, momentum=0.9),
     r"adamw takes no momentum \(its betas are the moments' decay rates\)$"),
    (OptimizerSpec("adamw", lr=1, betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    (OptimizerSpec("adamw", lr=1, betas=(-0.1, 0.9)), "betas must be two numbers"),
    (OptimizerSpec("adamw", lr=1, betas=(float("nan"), 0.9)), "betas must be two numbers"),
    (OptimizerSpec("adamw", lr=1, betas=(0.9,)), "betas must be two numbers"),
    (OptimizerSpec("adamw", lr=1, betas=(0.9, 0.9, 0.9)), "betas must be two numbers"),
    (OptimizerSpec("adamw", lr=1, eps=0), "eps must be a positive number, got 0"),
    (OptimizerSpec("adamw", lr=1, eps=float("inf")), "eps must be a positive number"),
]


# plain ids: mutmut passes node ids back to pytest, which cannot parse brackets or spaces in them
@pytest.mark.parametrize("spec, message", REFUSALS, ids=[f"{s.kind}-{k}" for k, (s, _) in enumerate(REFUSALS)])
def test_bad_hyper_parameters_are_refused_by_name(spec, message):
    with pytest.raises(InvalidOptionError, match="^" + message):
        spec.check()
    with pytest.raises(InvalidOptionError, match="^" + message):
        fuse_optimizer(_training_graph(), list(SHAPES), spec)


def test_the_edges_of_the_valid_ranges_are_accepted():
    for spec in [OptimizerSpec("sgd", lr=1e-12, momentum=0.0, weight_decay=0.0),
                 OptimizerSpec("sgd", lr=1, momentum=0.999),
                 OptimizerSpec("adamw", lr=1, betas=(0.0, 0.0), eps=1e-30, weight_decay=0.0)]:
        spec.check()


def test_a_graph_it_cannot_fuse_is_refused_by_name():
    model = _training_graph()
    with pytest.raises(InvalidModelError, match="^fuse_optimizer needs the outputs loss, then <param>_grad per parameter$"):
        fuse_optimizer(model, ["b", "w"], OptimizerSpec("sgd", lr=0.1))
    model = _training_graph()
    model.graph.node[2].output[0] = "w.exp_avg"       # a tensor under a name AdamW's state needs
    with pytest.raises(InvalidModelError, match=r"already has tensors named \['w.exp_avg'\]"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("adamw", lr=0.1))
    model = _training_graph()
    model.graph.node[2].output[0] = STEP_NAME
    with pytest.raises(InvalidModelError, match="already has tensors named"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("adamw", lr=0.1))
    model = _training_graph()
    model.graph.node[2].output[0] = "b.momentum_buffer_updated"
    with pytest.raises(InvalidModelError, match="already has tensors named"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1, momentum=0.5))
    model = _training_graph()
    model.graph.node[2].output[0] = "w_updated"
    with pytest.raises(InvalidModelError, match="already has tensors named"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1))
    model = _training_graph()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2, np.float32), "b.exp_avg"))  # not an input
    with pytest.raises(InvalidModelError, match=r"already has tensors named \['b.exp_avg'\]"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("adamw", lr=0.1))
    model = _training_graph()
    model.graph.node[3].output[0] = "other"           # b_grad made by no node
    with pytest.raises(InvalidModelError, match="the gradient 'b_grad' is not computed by any node"):
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1))


def test_a_parameter_or_statistic_already_an_input_is_not_added_twice():
    model = _training_graph()
    model.graph.input.extend([helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4]),
                              helper.make_tensor_value_info("stat", TensorProto.FLOAT, [2])])
    fuse_optimizer(model, list(SHAPES), OptimizerSpec("sgd", lr=0.1))
    assert [i.name for i in model.graph.input] == ["x", "gw", "gb", "w", "stat", "b"]


def test_a_name_clash_lists_the_first_five_names():
    model = _training_graph()
    taken = ["w_updated", "b_updated", "w.exp_avg", "w.exp_avg_sq", "b.exp_avg", "b.exp_avg_sq", STEP_NAME]
    model.graph.node.extend(helper.make_node("Neg", ["x"], [t], name=f"neg_{k}") for k, t in enumerate(taken))
    with pytest.raises(InvalidModelError) as refused:
        fuse_optimizer(model, list(SHAPES), OptimizerSpec("adamw", lr=0.1))
    assert str(refused.value) == (
        "the training graph already has tensors named ['w_updated', 'w.exp_avg', 'w.exp_avg_sq', 'b_updated', "
        "'b.exp_avg']: the optimizer's inputs and outputs need those names")
