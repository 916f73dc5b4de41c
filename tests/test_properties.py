"""Properties over spaces, not a few examples (hypothesis): random cost graphs and random plans,
random small ONNX models and their training graphs, each property against an oracle written
apart from the code it checks.

1. The cost model: `simulate` (vectorized) equals the step-by-step reference of
   tests/test_costmodel.py on random DAGs (sizes in bytes, times in seconds, aliases, folded
   constants, Shape-like ops, work buffers, graph outputs, droppable outputs) under random
   plans (random checkpoint sets, refresh gaps and base orders) and under random schedules
   with random recomputation; `make_plan`'s reported peak is the reference's on the order
   ONNX Runtime runs the plan's schedule in.
2. The rewrite: a random plan of a random training graph (random MLP and conv forwards with
   BatchNormalization and LayerNormalization, built by graphopt's builder) rewritten and run
   in ONNX Runtime gives bit-identical outputs to the original (stricter than verify's
   `compare_outputs` tolerance, 1e-5 relative: the same kernels on the same inputs, one
   deterministic thread), and ONNX Runtime runs it in the order the cost model priced.
3. `default_order` (the builder's prediction of ONNX Runtime's DEFAULT order) is the order ONNX
   Runtime's profile shows, on random ONNX DAGs (random file orders, Constants, multi-output
   nodes, an If reading outer tensors, dangling nodes) and on random training graphs.

Reproducible in CI: every test runs under `PROPERTY` (derandomized, no example database; a
failure prints the blob to reproduce it with ``@reproduce_failure``)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, note, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphopt.analyze import analyze
from graphopt.builder.file_order import default_order, static_tensor_bytes
from graphopt.builder.train_graph import build_training_graph
from graphopt.costgraph import CostGraph, Op
from graphopt.costmodel import check_schedule, priority_order, simulate
from graphopt.examples import example_inputs
from graphopt.op_rules import build_cost_graph
from graphopt.rewrite import PLANNED_SETTINGS, rewrite
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS
from graphopt.search.plan import make_plan, schedule_for
from graphopt.verify import executed_order, run_outputs

from test_costmodel import reference_live_bytes, reference_order

# CI runs the same examples every time (derandomize: examples derived from each test's name);
# no example database (nothing read or written between runs); a failure prints the
# @reproduce_failure blob.
PROPERTY = settings(derandomize=True, database=None, print_blob=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------------------------------------
# 1. the cost model on random DAGs
# ---------------------------------------------------------------------------------------------

tensor_bytes_st = st.integers(-150, 1000).map(lambda b: max(b, 0))     # 0 bytes now and then
seconds_st = st.floats(0.0, 3.0, allow_nan=False, allow_infinity=False)


@st.composite
def cost_graphs(draw) -> CostGraph:
    """A random training cost graph: resident inputs; forward ops reading any
    earlier tensors (edges respect the creation order, a topological order), some aliases
    (output 0 shares input 0's buffer), folded Constants, Shape-like (runs_first) and
    non-recomputable ops, work buffers, two-output ops; backward ops reading forward tensors
    and earlier gradients; some tensors graph outputs (kept), some of those bound, some unread
    outputs droppable; and a random topological base order, forward and backward ops interleaved."""
    tensor_bytes: dict[str, int] = {}
    resident = [f"x{k}" for k in range(draw(st.integers(1, 2)))]
    for x in resident:
        tensor_bytes[x] = draw(tensor_bytes_st)
    forward_tensors: list[str] = []

    def make_op(name: str, pool: list[str], prefix: str, backward: bool) -> Op:
        kind = draw(st.sampled_from(["plain", "plain", "alias", "folded", "two"] if not backward
                                    else ["plain", "plain", "alias", "two"]))
        if kind == "folded":
            inputs: tuple[str, ...] = ()
        else:
            count = draw(st.integers(1, 3))
            # index 0 is the latest tensor (shrinks towards a chain); duplicates allowed (Mul(a, a))
            inputs = tuple(pool[len(pool) - 1 - draw(st.integers(0, len(pool) - 1))] for _ in range(count))
        outputs = tuple(f"{prefix}{name}_{k}" for k in range(2 if kind == "two" else 1))
        for t in outputs:
            tensor_bytes[t] = tensor_bytes[inputs[0]] if kind == "alias" else draw(tensor_bytes_st)
        return Op(name, "Alias" if kind == "alias" else "Constant" if kind == "folded" else "F",
                  inputs, outputs, seconds=draw(seconds_st), alias=kind == "alias",
                  recomputable=draw(st.integers(0, 7)) > 0, runs_first=draw(st.integers(0, 7)) == 0,
                  folded=kind == "folded",
                  workspace_bytes=draw(st.sampled_from([0, 0, 0, 16, 300])))

    forward: list[Op] = []
    pool = list(resident)
    for i in range(draw(st.integers(1, 12))):
        op = make_op(f"f{i}", pool, "t", backward=False)
        forward.append(op)
        pool.extend(op.outputs)
        forward_tensors.extend(op.outputs)
    backward: list[Op] = []
    pool_b = list(resident) + forward_tensors
    for i in range(draw(st.integers(1, 12))):
        op = make_op(f"b{i}", pool_b, "g", backward=True)
        backward.append(op)
        pool_b.extend(op.outputs)
    produced = [t for op in forward + backward for t in op.outputs]
    read = {t for op in forward + backward for t in op.inputs}
    kept = {t for t in produced if draw(st.integers(0, 7)) == 0}
    unread = [t for t in produced if t not in read and t not in kept]
    droppable = {t for t in unread if draw(st.booleans())}
    # bound: outputs written into buffers the caller holds (a trainer's state), only those of
    # single-output ops, which no plan recomputes, and not of aliases (a bound view holds no
    # buffer of its input's, which the reference cannot say; see reference_graph)
    single = {op.outputs[0] for op in forward + backward
              if len(op.outputs) == 1 and not op.folded and not op.alias}
    bound = {t for t in sorted(kept & single) if draw(st.booleans())}
    graph = CostGraph(forward, backward, tensor_bytes, resident=resident, kept=kept, droppable=droppable,
                      recompute_factor=draw(st.sampled_from([1.0, 1.2])), bound=bound)
    return graph.in_order(random_topological_order(graph, draw))


def random_topological_order(graph: CostGraph, draw) -> list[str]:
    """A topological order of all of `graph`'s ops, each next op drawn among the ready ones
    (drawing 0 each time gives the graph's own order)."""
    waiting = {name: {graph.producer[t] for t in op.inputs if t in graph.producer}
               for name, op in graph.ops.items()}
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(waiting):
        ready = [name for name in graph.order if name not in done and waiting[name] <= done]
        name = ready[draw(st.integers(0, len(ready) - 1))]
        order.append(name)
        done.add(name)
    return order


def reference_graph(graph: CostGraph) -> CostGraph:
    """`graph` as the step-by-step reference sees it: it has no rule for bound outputs (written
    into the caller's buffers), which cost nothing when their copy 0 is written; with no copy
    >= 1 of them, that is a buffer of 0 bytes."""
    if not graph.bound:
        return graph
    d = graph.to_dict()
    d["tensor_bytes"] = {t: 0 if t in graph.bound else b for t, b in graph.tensor_bytes.items()}
    d["bound"] = []
    return CostGraph.from_dict(d)


def assert_simulate_is_the_reference(graph: CostGraph, executed) -> None:
    assert not any(c and graph.bound.intersection(graph.ops[n].outputs) for n, c in executed)
    sim = simulate(graph, executed)
    live = reference_live_bytes(reference_graph(graph), executed)
    assert sim.live_bytes.tolist() == live
    assert sim.peak_bytes == max(max(live, default=0), 0)
    k = graph.recompute_factor
    assert sim.compute_seconds == pytest.approx(sum(graph.ops[n].seconds * (k if c else 1) for n, c in executed))
    assert sim.recompute_seconds == pytest.approx(sum(graph.ops[n].seconds * k for n, c in executed if c))


@settings(PROPERTY, max_examples=300)
@given(graph=cost_graphs(), data=st.data())
def test_simulate_of_a_random_plan_is_the_step_by_step_reference(graph, data):
    """Random checkpoint sets (and refresh gaps) of a random graph: the order ONNX Runtime runs
    the plan in is the reference's, `simulate` of it is the reference's step by step, and
    `make_plan` reports the reference's peak, for each refresh gap of the same set."""
    note(f"graph: {graph.to_dict()}")
    candidates = list(graph.candidate_checkpoints)
    keep = data.draw(st.sets(st.sampled_from(candidates)) if candidates else st.just(set()), label="keep")
    for gap in data.draw(st.permutations([None, 0, 1, 3]), label="gaps"):
        schedule = schedule_for(graph, keep, gap)
        check_schedule(graph, schedule)
        executed = priority_order(graph, schedule)
        assert executed == reference_order(graph, schedule)
        assert_simulate_is_the_reference(graph, executed)
        plan = make_plan(graph, "property", keep, gap)
        assert plan.schedule == schedule
        assert plan.peak_bytes == max(max(reference_live_bytes(reference_graph(graph),
                                                               reference_order(graph, plan.schedule)), default=0), 0)


@settings(PROPERTY, max_examples=200)
@given(graph=cost_graphs(), data=st.data())
def test_simulate_of_a_random_schedule_with_recomputation_is_the_step_by_step_reference(graph, data):
    """Any valid schedule, not only the plans' ones: the base order with random forward ops
    recomputed (copies 1, 2, ...) at random places where their inputs exist; a later read
    reads the latest copy."""
    note(f"graph: {graph.to_dict()}")
    schedule = [(op, 0) for op in graph.order]
    copies: dict[str, int] = {}
    forward = [op for op in graph.forward_order
               if not graph.ops[op].folded and not graph.bound.intersection(graph.ops[op].outputs)]
    for _ in range(data.draw(st.integers(0, 6), label="recomputations") if forward else 0):
        op = data.draw(st.sampled_from(forward))
        producers = {graph.producer[t] for t in graph.ops[op].inputs if t in graph.producer}
        first = max((i for i, (name, _) in enumerate(schedule) if name in producers), default=-1) + 1
        where = data.draw(st.integers(first, len(schedule)), label=f"where {op}")
        copies[op] = copies.get(op, 0) + 1
        schedule.insert(where, (op, copies[op]))
    note(f"schedule: {schedule}")
    check_schedule(graph, schedule)
    executed = priority_order(graph, schedule)
    assert executed == reference_order(graph, schedule)
    assert_simulate_is_the_reference(graph, executed)


# ---------------------------------------------------------------------------------------------
# 2. random small ONNX training graphs (graphopt's builder), rewritten, in ONNX Runtime
# ---------------------------------------------------------------------------------------------

BATCH, WIDTH, CHANNELS, SIDE = 2, 4, 3, 5
MLP_KINDS = ("MatMul", "MatMul", "Tanh", "Relu", "Sigmoid", "Add", "Mul", "Sub", "Reshape",
             "LayerNormalization", "Softmax")
CONV_KINDS = ("Conv", "Conv", "BatchNormalization", "BatchNormalization", "Relu", "Tanh", "Add", "Mul", "Reshape")


@st.composite
def forward_models(draw) -> onnx.ModelProto:
    """A random small forward model with the same shape on every activation: an MLP ([2, 4]:
    MatMuls, activations, joins, LayerNormalization, Softmax, Reshape round trips) or a conv
    net ([2, 3, 5, 5]: 3x3 Convs, BatchNormalization, activations, joins, Reshapes), each op
    reading earlier activations (a DAG: branches and joins); every activation nobody reads is
    summed into the output, which goes through a last MatMul (a parameter always reaches the
    loss). Weights from a drawn seed."""
    conv = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    shape = [BATCH, CHANNELS, SIDE, SIDE] if conv else [BATCH, WIDTH]
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def weight(name, dims, scale=0.5, offset=0.0):
        inits.append(numpy_helper.from_array((rng.standard_normal(dims) * scale + offset).astype(np.float32), name))
        return name

    pool = ["x"]
    read: set[str] = set()

    def pick() -> str:
        t = pool[len(pool) - 1 - draw(st.integers(0, len(pool) - 1))]
        read.add(t)
        return t

    for i in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(CONV_KINDS if conv else MLP_KINDS))
        y = f"a{i}"
        n = helper.make_node
        if kind == "MatMul":
            nodes.append(n("MatMul", [pick(), weight(f"w{i}", [WIDTH, WIDTH])], [y], name=f"mm{i}"))
        elif kind == "Conv":
            nodes.append(n("Conv", [pick(), weight(f"k{i}", [CHANNELS, CHANNELS, 3, 3], 0.3),
                                    weight(f"kb{i}", [CHANNELS], 0.1)], [y], name=f"conv{i}", pads=[1, 1, 1, 1]))
        elif kind == "BatchNormalization":
            stats = [weight(f"bn{i}.scale", [CHANNELS], 0.2, 1.0), weight(f"bn{i}.bias", [CHANNELS], 0.1),
                     weight(f"bn{i}.mean", [CHANNELS], 0.3), weight(f"bn{i}.var", [CHANNELS], 0.2, 1.0)]
            nodes.append(n("BatchNormalization", [pick()] + stats, [y], name=f"bn{i}", epsilon=1e-5, momentum=0.9))
        elif kind == "LayerNormalization":
            nodes.append(n("LayerNormalization", [pick(), weight(f"ln{i}.scale", [WIDTH], 0.2, 1.0),
                                                  weight(f"ln{i}.bias", [WIDTH], 0.1)], [y], name=f"ln{i}"))
        elif kind in ("Add", "Mul", "Sub"):
            nodes.append(n(kind, [pick(), pick()], [y], name=f"{kind.lower()}{i}"))
        elif kind == "Reshape":           # two aliases: flattened and back
            flat_shape, back_shape = f"flat{i}", f"back{i}"
            inits.append(numpy_helper.from_array(np.array([-1], np.int64), flat_shape))
            inits.append(numpy_helper.from_array(np.array(shape, np.int64), back_shape))
            nodes.append(n("Reshape", [pick(), flat_shape], [f"{y}_flat"], name=f"flatten{i}"))
            nodes.append(n("Reshape", [f"{y}_flat", back_shape], [y], name=f"unflatten{i}"))
        else:
            nodes.append(n(kind, [pick()], [y], name=f"{kind.lower()}{i}"))
        pool.append(y)
    total = None
    for k, t in enumerate(t for t in pool[1:] if t not in read):
        if total is None:
            total = t
        else:
            nodes.append(helper.make_node("Add", [total, t], [f"sum{k}"], name=f"sum{k}"))
            total = f"sum{k}"
    if total is None:
        total = pool[-1]
    if conv:
        nodes.append(helper.make_node("GlobalAveragePool", [total], ["pooled"], name="pool"))
        nodes.append(helper.make_node("Flatten", ["pooled"], ["features"], name="flat"))
        nodes.append(helper.make_node("MatMul", ["features", weight("head", [CHANNELS, WIDTH])], ["y"], name="head"))
    else:
        nodes.append(helper.make_node("MatMul", [total, weight("head", [WIDTH, WIDTH])], ["y"], name="head"))
    graph = helper.make_graph(nodes, "random", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def training_graphs():
    """Random forward models built into training graphs (an MSE loss) by graphopt's builder."""
    return forward_models().map(lambda forward: build_training_graph(forward, loss="mse"))


@settings(PROPERTY, max_examples=25)
@given(model=training_graphs(), data=st.data())
def test_the_rewrite_of_a_random_plan_gives_the_original_outputs_in_onnx_runtime(model, data):
    """A random plan of a random training graph (random checkpoints, refresh gap and base order),
    rewritten: ONNX Runtime gives bit-identical outputs to the original (loss, every gradient,
    the updated BatchNormalization statistics) and runs the rewritten graph in the order the
    cost model priced. Only plans that recompute something count."""
    feeds = example_inputs(model)
    training = analyze(model)
    graph = build_cost_graph(training, static_tensor_bytes(model), {})
    graph = graph.in_order(random_topological_order(graph, data.draw))
    # any tensors to keep: the candidates, and those an op overwrites in place (a training-mode
    # BatchNormalization's statistics), which make_plan must ignore
    candidates = list(graph.candidate_checkpoints) + sorted(graph.clobbered)
    keep = data.draw(st.sets(st.sampled_from(candidates)) if candidates else st.just(set()), label="keep")
    plan = make_plan(graph, "property", keep, data.draw(st.sampled_from([None, 0, 1, 3]), label="gap"))
    assume(plan.recompute_ops > 0)
    note(onnx.printer.to_text(model.graph))
    note(f"plan: keep {sorted(plan.checkpoints)}, refresh gap {plan.refresh_gap}, schedule {plan.schedule}")
    rewritten = rewrite(training, graph, plan)
    onnx.checker.check_model(rewritten)

    original = run_outputs(model, feeds, UNOPTIMIZED_SETTINGS)
    replayed = run_outputs(rewritten, feeds)                 # its own settings: PLANNED_SETTINGS
    assert list(replayed) == list(original)
    for name, value in original.items():
        assert replayed[name].dtype == value.dtype and replayed[name].shape == value.shape, name
        assert np.array_equal(replayed[name], value, equal_nan=True), \
            (name, float(np.max(np.abs(replayed[name].astype(np.float64) - value))))

    priced = [op if copy == 0 else f"{op}__rc{copy}" for op, copy in priority_order(graph, plan.schedule)]
    assert executed_order(rewritten, feeds, PLANNED_SETTINGS) == priced


# ---------------------------------------------------------------------------------------------
# 3. default_order is ONNX Runtime's DEFAULT order
# ---------------------------------------------------------------------------------------------

DAG_KINDS = ("Add", "Mul", "Sub", "Tanh", "Relu", "Neg", "Identity", "Constant", "LayerNormalization", "If")


@st.composite
def onnx_dags(draw) -> onnx.ModelProto:
    """A random ONNX DAG of float tensors ([2, 4], or [2, 1] where LayerNormalization's mean and
    inverse deviation go; all broadcast together): one or two inputs, an initializer, nodes of
    the kinds above reading any earlier tensors (Constants: no inputs; LayerNormalization:
    three outputs; an If whose branches read two outer tensors), written to the file in a
    random topological order, node names unrelated to file positions. Tensors nobody reads
    are graph outputs, or dangling; some others are graph outputs too."""
    inputs = [f"in{k}" for k in range(draw(st.integers(1, 2)))]
    pool = inputs + ["init"]
    created: list[tuple[onnx.NodeProto, set[int]]] = []    # (node, indices of the nodes it reads)
    producer: dict[str, int] = {}
    n = helper.make_node
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(DAG_KINDS))

        def pick() -> str:
            return pool[len(pool) - 1 - draw(st.integers(0, len(pool) - 1))]
        name = f"node{(i * 7) % 13}_{i}"                    # not in file order
        y = f"v{i}"
        if kind == "Constant":
            node = n("Constant", [], [y], name=name,
                     value=numpy_helper.from_array(np.full([1, 4], 0.5 + i, np.float32)))
        elif kind in ("Add", "Mul", "Sub"):
            node = n(kind, [pick(), pick()], [y], name=name)
        elif kind == "LayerNormalization":
            node = n(kind, [pick(), "scale"], [y, f"{y}_mean", f"{y}_inv"], name=name, axis=-1)
        elif kind == "If":
            a, b = pick(), pick()
            branch = lambda op, out: helper.make_graph(  # noqa: E731  (nodes named, as ingest.name_nodes does)
                [n(op, [a, b], [out], name=f"{name}/{op}")], out, [],
                [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["rows", "columns"])])
            node = n("If", ["flag"], [y], name=name, then_branch=branch("Add", f"{y}_then"),
                     else_branch=branch("Sub", f"{y}_else"))
        else:
            node = n(kind, [pick()], [y], name=name)
        reads = {producer[t] for t in node.input if t in producer}
        if kind == "If":
            reads |= {producer[t] for t in (a, b) if t in producer}
        for t in node.output:
            producer[t] = i
            pool.append(t)
        created.append((node, reads))
    # the file: a random topological order of the nodes
    order: list[int] = []
    while len(order) < len(created):
        ready = [i for i, (_, reads) in enumerate(created) if i not in order and reads <= set(order)]
        order.append(ready[draw(st.integers(0, len(ready) - 1))])
    nodes = [created[i][0] for i in order]
    read = {t for node, _ in created for t in node.input} | {t for node, _ in created if node.op_type == "If"
                                                             for g in node.attribute for t in g.g.node[0].input}
    produced = [t for node, _ in created for t in node.output]
    outputs = [t for t in produced if (t not in read and draw(st.integers(0, 3)) > 0)
               or (t in read and draw(st.integers(0, 5)) == 0)]
    if not outputs:
        outputs = [produced[-1]]
    graph = helper.make_graph(
        nodes, "dag",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 4]) for x in inputs]
        + [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(t, TensorProto.FLOAT, ["rows", "columns"]) for t in outputs],
        [numpy_helper.from_array(np.full([2, 4], 0.25, np.float32), "init"),
         numpy_helper.from_array(np.ones([1], np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def assert_default_order_is_the_profiled_one(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    note(onnx.printer.to_text(model.graph))
    ran = executed_order(model, feeds, UNOPTIMIZED_SETTINGS)     # ORT's DEFAULT order, profiled
    assert [model.graph.node[k].name for k in default_order(model)] == ran


@settings(PROPERTY, max_examples=100)
@given(model=onnx_dags(), flag=st.booleans())
def test_default_order_is_onnx_runtimes_order_on_random_dags(model, flag):
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal([2, 4]).astype(np.float32) for v in model.graph.input if v.name != "flag"}
    feeds["flag"] = np.array(flag)
    assert_default_order_is_the_profiled_one(model, feeds)


@settings(PROPERTY, max_examples=20)
@given(model=training_graphs())
def test_default_order_is_onnx_runtimes_order_on_random_training_graphs(model):
    assert_default_order_is_the_profiled_one(model, example_inputs(model))
