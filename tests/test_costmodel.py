"""The one cost model against independent step-by-step references.

`simulate` is vectorized (numpy over the schedule's reads and writes) and `priority_order`
takes a fast path; the references here walk the schedule one step at a time, by the rules
of costmodel's docstring: a buffer per write (an alias's output 0 shares the buffer its
input 0 resolved to; a folded op's outputs and resident tensors have none), freed after its
last reader unless it is a graph output (copy 0) or never read (then kept, or free if
droppable); a step's peak includes its inputs, outputs and work buffer. ORT's order:
Kahn's algorithm over the versions each step reads, Shape-like (runs_first) steps first,
then the lowest position."""
import dataclasses
import heapq
import random

import numpy as np

import pytest

from graphopt.costgraph import CostGraph, Op
from graphopt.costmodel import check_schedule, live_at, priority_order, resolve_versions, simulate
from graphopt.search.plan import schedule_for

from graphopt_zoo.synthetic import branching_cost_graph, training_cost_graph


def reference_live_bytes(graph: CostGraph, schedule) -> list[int]:
    return reference_liveness(graph, schedule)[0]


def reference_liveness(graph: CostGraph, schedule) -> tuple[list[int], list[list]]:
    """Bytes live at each step, and every buffer: [bytes, born, last read, kept, droppable, tensor]."""
    ops = graph.ops
    latest = {}                 # tensor -> buffer id of its latest version (None: resident)
    buffers = []                # [bytes, born step, last read step, kept, droppable, tensor]
    for i, (name, copy) in enumerate(schedule):
        op = ops[name]
        for t in op.inputs:
            b = latest.get(t)
            if b is not None:
                buffers[b][2] = i
        for k, t in enumerate(op.outputs):
            if op.folded:
                latest[t] = None
                continue
            if k == 0 and op.alias and op.inputs:
                source = op.inputs[0]
                if source in latest or source in graph.resident:
                    b = latest.get(source)
                    latest[t] = b
                    if b is not None and copy == 0 and t in graph.kept:
                        buffers[b][3] = True
                    continue
            latest[t] = len(buffers)
            buffers.append([graph.tensor_bytes.get(t, 0), i, i, copy == 0 and t in graph.kept,
                            t in graph.droppable, t])
    live = []
    for i, (name, _) in enumerate(schedule):
        total = graph.ops[name].workspace_bytes
        for nbytes, born, last, kept, droppable, _ in buffers:
            if born > i:
                continue
            never_read = last == born
            if never_read and droppable:
                continue
            if never_read or kept or last >= i:
                total += nbytes
        live.append(total)
    return live, buffers


def reference_alive(graph: CostGraph, schedule, step: int) -> list[tuple]:
    """(tensor, copy, bytes, producer, born, last read, output) of each buffer live at `step`."""
    _, buffers = reference_liveness(graph, schedule)
    alive = []
    for nbytes, born, last, kept, droppable, tensor in buffers:
        never_read = last == born
        if born > step or (never_read and droppable):
            continue
        if never_read or kept or last >= step:
            alive.append((tensor, schedule[born][1], nbytes, schedule[born][0], born, last, kept))
    return sorted(alive)


def reference_order(graph: CostGraph, schedule):
    schedule = [s for s in schedule if not graph.ops[s[0]].folded]
    writer = {}                 # (tensor, version) -> last step writing it
    latest = {}
    deps = []
    for i, (name, copy) in enumerate(schedule):
        deps.append({(t, latest[t]) for t in graph.ops[name].inputs if t in latest})
        for t in graph.ops[name].outputs:
            latest[t] = copy
            writer[(t, copy)] = i
    waiting = [{writer[v] for v in d if v in writer} for d in deps]
    users = [[] for _ in schedule]
    for i, w in enumerate(waiting):
        for j in w:
            users[j].append(i)
    count = [len(w) for w in waiting]
    m = len(schedule)
    key = [i - m if graph.ops[schedule[i][0]].runs_first else i for i in range(m)]
    ready = [key[i] for i in range(m) if count[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        i = k + m if k < 0 else k
        order.append(schedule[i])
        for j in users[i]:
            count[j] -= 1
            if count[j] == 0:
                heapq.heappush(ready, key[j])
    return order


def _with_flags(graph: CostGraph, rng: random.Random, runs_first: float) -> CostGraph:
    """The graph with some ops made Shape-like (runs_first), a Constant (folded at load)
    read by a few ops, one of them an alias of it, and a view of a view of the first forward
    op's output (aliases of aliases share one buffer) read by the last forward op."""
    readers = set(rng.sample(list(graph.ops), 3))

    def change(name):
        op = graph.ops[name]
        inputs = op.inputs + ("const",) if name in readers else op.inputs
        return dataclasses.replace(op, inputs=inputs, runs_first=rng.random() < runs_first)
    constant = [Op("const_op", "Constant", (), ("const",), folded=True),
                Op("const_view", "Reshape", ("const",), ("const_r",), alias=True)]
    first = change(graph.forward_order[0])
    views = [Op("view_a", "Reshape", (first.outputs[0],), ("view_a_out",), alias=True),
             Op("view_b", "Flatten", ("view_a_out",), ("view_b_out",), alias=True)]
    forward = constant + [first] + views + [change(n) for n in graph.forward_order[1:]]
    last = forward[-1]
    forward[-1] = dataclasses.replace(last, inputs=last.inputs + ("const_r", "view_b_out"))
    size = graph.tensor_bytes[first.outputs[0]]
    return CostGraph(forward, [change(n) for n in graph.backward_order],
                     {**graph.tensor_bytes, "const": 64, "const_r": 64, "view_a_out": size, "view_b_out": size},
                     graph.resident, graph.kept,
                     graph.droppable, recompute_factor=rng.choice([1.0, 1.2]))


def _graphs():
    for seed in range(12):
        yield branching_cost_graph(6 + seed, seed=seed)
    for seed in range(4):
        yield training_cost_graph(10, seed=seed, max_fanin=3)


@pytest.mark.parametrize("graph", list(_graphs()), ids=lambda g: repr(g))
def test_simulate_and_order_equal_step_by_step_references(graph):
    rng = random.Random(len(graph))
    candidates = list(graph.candidate_checkpoints)
    for trial in range(6):
        g = _with_flags(graph, rng, runs_first=0.15 * (trial % 3))
        keep = {t for t in candidates if rng.random() < 0.5}
        schedule = schedule_for(g, keep, rng.choice([None, 0, 2]))
        executed = priority_order(g, schedule)
        assert executed == reference_order(g, schedule)
        # as planning calls it, told that schedule_for's steps are distinct
        assert priority_order(g, schedule, distinct_steps=True) == executed
        sim = simulate(g, executed)
        live = reference_live_bytes(g, executed)
        assert sim.live_bytes.tolist() == live
        assert sim.peak_bytes == max(live, default=0)
        # a recomputed copy takes recompute_factor times its op's seconds
        k = g.recompute_factor
        assert sim.compute_seconds == pytest.approx(sum(g.ops[n].seconds * (k if c else 1) for n, c in executed))
        assert sim.recompute_seconds == pytest.approx(sum(g.ops[n].seconds * k for n, c in executed if c))
        # what is live at a step, buffer by buffer (the peak's, and two others)
        for step in {sim.peak_step, random.Random(trial).randrange(len(executed)), len(executed) - 1}:
            buffers, workspace = live_at(g, executed, step)
            assert workspace == g.ops[executed[step][0]].workspace_bytes
            assert sorted((b.tensor, b.copy, b.bytes, b.producer, b.born, b.last_read, b.output)
                          for b in buffers) == reference_alive(g, executed, step)
            assert [b.bytes for b in buffers] == sorted((b.bytes for b in buffers), reverse=True)
            assert sum(b.bytes for b in buffers) + workspace == live[step]
            # with sizes of its own (what the floor zeroes): what simulate counts with them
            sizes = g.tensor_bytes_by_id.copy()
            sizes[::2] = 0
            buffers, workspace = live_at(g, executed, step, sizes)
            assert sum(b.bytes for b in buffers) + workspace == simulate(g, executed, sizes).live_bytes[step]


@pytest.mark.parametrize("graph", list(_graphs())[::3], ids=lambda g: repr(g))
def test_schedule_for_refuses_exactly_the_schedules_longer_than_max_steps(graph):
    """`max_steps` bounds the work of evaluating a plan: None exactly where the schedule
    without the bound is longer, the same schedule otherwise (at, just under and just over
    its length, for plans that recompute and plans that do not)."""
    rng = random.Random(7)
    candidates = sorted(graph.candidate_checkpoints)
    for trial in range(8):
        keep = {t for t in candidates if rng.random() < 0.4 * (trial % 3)}
        gap = rng.choice([None, 0, 2])
        full = schedule_for(graph, keep, gap)
        for bound in (len(full) - 1, len(full), len(full) + 1, len(graph.forward_order)):
            bounded = schedule_for(graph, keep, gap, bound)
            assert bounded == (full if len(full) <= bound else None), (trial, gap, bound, len(full))


@pytest.mark.parametrize("graph", list(_graphs())[::2], ids=lambda g: repr(g))
def test_priority_order_by_the_letter_equals_the_reference_on_repeated_steps(graph):
    """A schedule whose steps repeat (the same (op, copy) twice) or whose copies are negative is
    not a plan's; `priority_order` takes its general path there (`_priority_order_general`: a
    read depends on the LAST step writing that version, which may come later). Against the
    step-by-step reference, on schedules made so from plans' ones."""
    rng = random.Random(len(graph) + 7)
    candidates = list(graph.candidate_checkpoints)
    for trial in range(8):
        g = _with_flags(graph, rng, runs_first=0.15 * (trial % 3))
        schedule = list(schedule_for(g, {t for t in candidates if rng.random() < 0.5}, rng.choice([None, 0, 2])))
        for _ in range(rng.randint(1, 3)):
            name, copy = schedule[rng.randrange(len(schedule))]
            where = rng.randrange(len(schedule) + 1)
            schedule.insert(where, (name, -1 if trial % 2 else copy))
        executed = priority_order(g, schedule)
        assert executed == reference_order(g, schedule), (trial, schedule)


def test_the_empty_schedule_costs_nothing():
    graph = next(iter(_graphs()))
    sim = simulate(graph, [])
    assert (sim.peak_bytes, sim.peak_step, sim.compute_seconds, sim.recompute_seconds) == (0, 0, 0.0, 0.0)
    assert isinstance(sim.peak_bytes, int) and isinstance(sim.compute_seconds, float)
    assert sim.live_bytes.shape == (0,) and sim.live_bytes.dtype == np.int64
    assert priority_order(graph, []) == []


# ---- small graphs worked by hand from the module docstring's rules (x is resident: not counted)

def _graph(ops, tensor_bytes, **sets) -> CostGraph:
    return CostGraph(ops, [], {"x": 1000, **tensor_bytes}, resident=["x"], **sets)


def _assert_live(graph, schedule, expected, sizes_graph=None, **kwargs):
    """`simulate` gives the hand-worked live bytes, as the step-by-step reference does (on
    `sizes_graph` when the sizes come from another graph), its peak at a step holding it."""
    sim = simulate(graph, schedule, **kwargs)
    assert reference_live_bytes(sizes_graph or graph, schedule) == expected
    assert sim.live_bytes.dtype == np.int64 and sim.live_bytes.tolist() == expected
    assert sim.peak_bytes == max(expected) and isinstance(sim.peak_bytes, int)
    assert 0 <= sim.peak_step < len(schedule) and expected[sim.peak_step] == max(expected)


A = Op("A", "F", ("x",), ("a",))
B = Op("B", "F", ("a",), ("b",))


def test_a_buffer_lives_until_its_last_read_even_when_nothing_is_freed_at_the_last_step():
    # a (10) freed after B reads it; b (20) and c (40) never read, not droppable: kept
    g = _graph([A, B, Op("C", "F", ("x",), ("c",))], {"a": 10, "b": 20, "c": 40})
    _assert_live(g, [("A", 0), ("B", 0), ("C", 0)], [10, 30, 60])


def test_a_last_step_that_allocates_nothing_and_reads_of_residents_in_between():
    # V: a view of resident x (no buffer); W views b, reading b's buffer at step 3; Y views a
    g = _graph([A, Op("B", "F", ("x",), ("b",)), Op("V", "Reshape", ("x",), ("v",), alias=True),
                Op("W", "Reshape", ("b",), ("w",), alias=True), Op("Y", "Reshape", ("a",), ("y",), alias=True)],
               {"a": 10, "b": 20, "v": 1000, "w": 20, "y": 10})
    _assert_live(g, [("A", 0), ("B", 0), ("V", 0), ("W", 0), ("Y", 0)], [10, 30, 30, 30, 10])
    _assert_live(g, [("A", 0), ("B", 0), ("W", 0), ("V", 0), ("Y", 0)], [10, 30, 30, 10, 10])


def test_a_view_of_a_tensor_never_produced_has_its_own_buffer():
    # u: neither resident nor produced (a schedule check_schedule refuses): V's output gets a
    # buffer of its own (8), freed after B reads it
    g = _graph([A, Op("V", "Reshape", ("u",), ("v",), alias=True), Op("B", "F", ("v",), ("b",)),
                Op("C", "F", ("x",), ("c",))], {"a": 10, "u": 8, "v": 8, "b": 20, "c": 40})
    _assert_live(g, [("A", 0), ("V", 0), ("B", 0), ("C", 0)], [10, 18, 38, 70])


def test_a_bound_output_costs_nothing_when_written_and_its_bytes_when_recomputed():
    g = CostGraph([A, B], [], {"x": 1000, "a": 10, "b": 20}, resident=["x"], kept=["a"], bound=["a"])
    assert simulate(g, [("A", 0), ("B", 0)]).live_bytes.tolist() == [0, 20]
    assert simulate(g, [("A", 0), ("A", 1), ("B", 0)]).live_bytes.tolist() == [0, 10, 30]


def test_a_zero_peak_is_at_step_0_and_a_one_byte_peak_is_one_byte():
    for size in (0, 1):
        g = _graph([A], {"a": size})
        sim = simulate(g, [("A", 0)])
        assert (sim.peak_bytes, sim.peak_step, sim.live_bytes.tolist()) == (size, 0, [size])


def test_simulate_with_the_tensor_sizes_of_another_graph():
    """`tensor_bytes_by_id` (by the graph's tensor ids) replaces the graph's sizes."""
    ops = [A, B, Op("C", "F", ("x",), ("c",))]
    g = _graph(ops, {"a": 10, "b": 20, "c": 40})
    other = _graph(ops, {"a": 1, "b": 2, "c": 4})
    assert other.tensor_names == g.tensor_names
    _assert_live(g, [("A", 0), ("B", 0), ("C", 0)], [1, 3, 6], sizes_graph=other,
                 tensor_bytes_by_id=other.tensor_bytes_by_id)


def test_resolve_versions_reads_the_latest_copy_written_before_the_step():
    g = _graph([A, B], {"a": 10, "b": 20})
    steps = resolve_versions(g, [("A", 0), ("B", 0), ("A", 2), ("B", 1)])
    assert [(s.op, s.copy, s.reads, s.writes) for s in steps] == [
        ("A", 0, [("x", -1)], [("a", 0)]),
        ("B", 0, [("a", 0)], [("b", 0)]),
        ("A", 2, [("x", -1)], [("a", 2)]),
        ("B", 1, [("a", 2)], [("b", 1)])]


@pytest.mark.parametrize("graph", list(_graphs())[::4], ids=lambda g: repr(g))
def test_resolve_versions_on_plans_reads_what_the_last_earlier_write_wrote(graph):
    """Each read: the copy of the nearest EARLIER step writing the tensor (searched backwards
    from the step), -1 when none does."""
    rng = random.Random(3)
    for gap in (None, 0, 2):
        schedule = schedule_for(graph, {t for t in graph.candidate_checkpoints if rng.random() < 0.5}, gap)
        steps = resolve_versions(graph, schedule)
        assert [(s.op, s.copy) for s in steps] == schedule
        for i, s in enumerate(steps):
            assert s.writes == [(t, s.copy) for t in graph.ops[s.op].outputs]
            for t, version in s.reads:
                writers = [c for name, c in schedule[:i] if t in graph.ops[name].outputs]
                assert version == (writers[-1] if writers else -1)
            assert [t for t, _ in s.reads] == list(graph.ops[s.op].inputs)


def test_check_schedule_refuses_a_read_before_its_tensor_exists_and_names_it():
    g = _graph([A, B], {"a": 10, "b": 20})
    check_schedule(g, [("A", 0), ("B", 0), ("A", 1), ("B", 1)])     # x is resident
    with pytest.raises(ValueError, match=r"step 0 \(B, copy 3\) reads 'a' before it exists"):
        check_schedule(g, [("B", 3), ("A", 0)])
    g = _graph([A, B, Op("C", "F", ("x",), ("c",))], {"a": 10, "b": 20, "c": 40})
    with pytest.raises(ValueError, match=r"step 1 \(B, copy 0\) reads 'a' before it exists"):
        check_schedule(g, [("C", 0), ("B", 0), ("A", 0)])


def test_priority_order_by_the_letter_with_a_step_that_reads_nothing():
    """N reads nothing (ready at once); B's read of (a, 0) waits for the LAST step writing it."""
    g = _graph([A, Op("N", "RandomNormal", (), ("n",)), Op("B", "F", ("a", "n"), ("b",))],
               {"a": 10, "n": 5, "b": 20})
    schedule = [("A", 0), ("N", 0), ("B", 0), ("A", 0)]
    expected = [("A", 0), ("N", 0), ("A", 0), ("B", 0)]
    assert reference_order(g, schedule) == expected
    assert priority_order(g, schedule) == expected


def test_priority_order_refuses_a_dependency_cycle():
    """A and B read each other's outputs: by the letter, B's read of (a, 0) waits for the last
    (A, 0), which reads the (b, 0) B writes."""
    g = CostGraph([Op("A", "F", ("b",), ("a",)), Op("B", "F", ("a",), ("b",))], [], {"a": 10, "b": 20})
    with pytest.raises(ValueError, match="^schedule has a dependency cycle$"):
        priority_order(g, [("A", 0), ("B", 0), ("A", 0)])
