"""The rules of graphopt/builder/file_order.py, one at a time, on node lists small enough to work
out by hand: where `sink_to_readers` moves a node and where it must leave it (each expected
order below is derived from its docstring: a node goes to right before its first reader when its
outputs are larger than the inputs whose life that would extend, inputs another node reads there
or later and residents not counted; it stays when a size is unknown, when it writes a graph
output or holds a subgraph), which tensors `static_tensor_bytes` can size, and which candidate
`leanest_file_order` writes. tests/test_file_order.py checks the same code against ONNX Runtime
on real training graphs; both files are what mutation testing runs against this module."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.builder.file_order import leanest_file_order, sink_to_readers, static_tensor_bytes


def _node(name: str, inputs: list[str], outputs: list[str], **attributes) -> onnx.NodeProto:
    return helper.make_node("Custom", inputs, outputs, name=name, domain="test", **attributes)


def _sunk(nodes: list[onnx.NodeProto], sizes: dict[str, int], resident=("x", "w"), outputs=("z",)) -> list[str]:
    return [n.name for n in sink_to_readers(nodes, sizes, set(resident), set(outputs))]


def _late_reader(a_inputs: list[str], z_inputs: list[str] = ("c", "a")) -> list[onnx.NodeProto]:
    """P makes p; A reads `a_inputs`, makes a; B and C make c in between; Z reads a at the end."""
    return [_node("P", ["x"], ["p"]), _node("A", a_inputs, ["a"]), _node("B", ["x"], ["b"]),
            _node("C", ["b"], ["c"]), _node("Z", list(z_inputs), ["z"])]


IN_FILE = ["P", "A", "B", "C", "Z"]
SUNK = ["B", "C", "P", "A", "Z"]     # A right before Z, and P (read only by A, from a resident) with it


@pytest.mark.parametrize("a_bytes,expected", [(11, SUNK), (10, IN_FILE), (0, IN_FILE)])
def test_a_node_moves_only_when_its_outputs_outweigh_what_it_keeps_alive(a_bytes, expected):
    """A's output (a_bytes) against its input p (10 bytes, read by nobody else): strictly larger
    moves, equal or smaller stays. C's output equals its input b, so C stays."""
    sizes = {"p": 10, "a": a_bytes, "b": 5, "c": 5, "z": 1}
    assert _sunk(_late_reader(["p"]), sizes) == expected


def test_the_inputs_whose_life_would_be_extended_add_up():
    """p and q (6 bytes each, read by A alone) outlive A's move together: 12 >= a's 10."""
    nodes = [_node("P", ["x"], ["p"]), _node("Q", ["x"], ["q"]), _node("A", ["p", "q"], ["a"]),
             _node("B", ["x"], ["b"]), _node("C", ["b"], ["c"]), _node("Z", ["c", "a"], ["z"])]
    sizes = {"p": 6, "q": 6, "a": 10, "b": 5, "c": 5, "z": 1}
    assert _sunk(nodes, sizes) == ["P", "Q", "A", "B", "C", "Z"]
    assert _sunk(nodes, {**sizes, "a": 13}) == ["B", "C", "P", "Q", "A", "Z"]


def test_residents_are_not_counted_whatever_their_place_among_the_inputs():
    """w is resident (alive anyway): only p (100 bytes) counts against a (5 bytes)."""
    sizes = {"p": 100, "a": 5, "b": 5, "c": 5, "z": 1}
    assert _sunk(_late_reader(["w", "p"]), sizes) == IN_FILE
    assert _sunk(_late_reader(["w", "p"]), {**sizes, "p": 4}) == SUNK


def test_an_input_read_at_the_new_place_or_later_is_not_counted():
    """p is read by Z too (the reader A moves to): A's move extends nothing, whatever p weighs."""
    sizes = {"p": 100, "a": 5, "b": 5, "c": 5, "z": 1}
    assert _sunk(_late_reader(["p"], ["c", "a", "p"]), sizes) == SUNK
    # read later than the new place: after Z, by Y
    nodes = _late_reader(["p"], ["c", "a"]) + [_node("Y", ["p", "z"], ["y"])]
    assert _sunk(nodes, sizes, outputs=("y",)) == SUNK + ["Y"]
    # read earlier than the new place (by B): p's life is extended by the move
    nodes = _late_reader(["p"])
    nodes[2] = _node("B", ["x", "p"], ["b"])
    assert _sunk(nodes, sizes) == IN_FILE


def test_every_input_is_weighed_after_one_that_is_read_later():
    """A reads p (read by Z as well: not counted), then q (100 bytes, read by A alone: counted)."""
    nodes = [_node("P", ["x"], ["p"]), _node("Q", ["x"], ["q"]), _node("A", ["p", "q"], ["a"]),
             _node("B", ["x"], ["b"]), _node("C", ["b"], ["c"]), _node("Z", ["c", "a", "p"], ["z"])]
    sizes = {"p": 1, "q": 100, "a": 5, "b": 5, "c": 5, "z": 1}
    assert _sunk(nodes, sizes) == ["P", "Q", "A", "B", "C", "Z"]


def test_a_node_stays_when_a_size_it_needs_is_unknown_and_the_others_still_move():
    """U's output u has no size: U stays; C reads u: C stays (its cost is unknown); E, the first
    node, is still moved to its late reader Z."""
    nodes = [_node("E", ["x"], ["e"]), _node("U", ["x"], ["u"]), _node("B", ["x"], ["b"]),
             _node("C", ["b", "u"], ["c"]), _node("Z", ["c", "e"], ["z"])]
    sizes = {"e": 5, "b": 5, "c": 50, "z": 1}      # no "u"
    assert _sunk(nodes, sizes) == ["U", "B", "C", "E", "Z"]


def test_a_node_nobody_reads_stays_and_the_others_still_move():
    nodes = [_node("E", ["x"], ["e"]), _node("B", ["x"], ["b"]), _node("C", ["b"], ["c"]),
             _node("DEAD", ["x"], ["dead"]), _node("Z", ["c", "e"], ["z"])]
    sizes = {"e": 5, "b": 5, "c": 5, "dead": 100, "z": 1}
    assert _sunk(nodes, sizes) == ["B", "C", "DEAD", "E", "Z"]


def test_a_node_that_writes_a_graph_output_stays():
    nodes = [_node("G", ["x"], ["g"]), _node("B", ["x"], ["b"]), _node("C", ["b"], ["c"]),
             _node("Z", ["c", "g"], ["z"])]
    sizes = {"g": 5, "b": 5, "c": 5, "z": 1}
    assert _sunk(nodes, sizes, outputs=("z",)) == ["B", "C", "G", "Z"]
    assert _sunk(nodes, sizes, outputs=("z", "g")) == ["G", "B", "C", "Z"]


def test_a_node_that_holds_a_subgraph_stays():
    body = helper.make_graph([], "body", [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])])
    nodes = [_node("G", ["x"], ["g"], body=body), _node("B", ["x"], ["b"]), _node("C", ["b"], ["c"]),
             _node("Z", ["c", "g"], ["z"])]
    sizes = {"g": 5, "b": 5, "c": 5, "z": 1}
    assert _sunk(nodes, sizes) == ["G", "B", "C", "Z"]
    nodes[0] = _node("G", ["x"], ["g"])
    assert _sunk(nodes, sizes) == ["B", "C", "G", "Z"]


# -- static_tensor_bytes -------------------------------------------------------------------------
def test_static_tensor_bytes_sizes_what_inference_knows_fully_and_nothing_else():
    """Tensors of unknown size come first in each list (a symbolic dim, an undefined element type,
    an unknown rank): each is left out, and every tensor after it is still sized."""
    nodes = [helper.make_node("Relu", ["s"], ["s1"], name="symbolic"),        # [N, 3]
             helper.make_node("Relu", ["x"], ["x1"], name="known"),
             helper.make_node("Reshape", ["x1", "shp"], ["r"], name="unknown_rank"),
             helper.make_node("Relu", ["x1"], ["x2"], name="known_too"),
             helper.make_node("Cast", ["x2"], ["i2"], name="to_int64", to=TensorProto.INT64)]
    inputs = [helper.make_tensor_value_info("u", TensorProto.UNDEFINED, [2]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", 3]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
              helper.make_tensor_value_info("shp", TensorProto.INT64, ["K"]),
              helper.make_tensor_value_info("h", TensorProto.FLOAT16, [5, 1, 7])]
    outputs = [helper.make_tensor_value_info("r", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("i2", TensorProto.INT64, None)]
    model = helper.make_model(helper.make_graph(nodes, "sizes", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    # float32 [2, 3]: 24 bytes; int64 [2, 3]: 48; float16 [5, 1, 7]: 70
    assert static_tensor_bytes(model) == {"x": 24, "x1": 24, "x2": 24, "i2": 48, "h": 70}


# -- leanest_file_order --------------------------------------------------------------------------
def _tied_model() -> onnx.ModelProto:
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_file_order import _tied_embedding_with_a_wide_middle
    return _tied_embedding_with_a_wide_middle()


def _written(model: onnx.ModelProto, candidates: list[list[str]]) -> tuple[int, list[str]]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    peak = leanest_file_order(copy, candidates)
    return peak, [n.name for n in copy.graph.node]


def test_leanest_file_order_returns_the_peak_of_the_order_it_writes():
    """The peak returned is the cost model's peak of the graph run as written, nothing
    recomputed: what the store-all plan of the cost graph in that base order predicts."""
    from graphopt.analyze import analyze
    from graphopt.op_rules import build_cost_graph
    from graphopt.search import store_all
    model = _tied_model()
    peak, written = _written(model, [[n.name for n in model.graph.node]])
    graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {}).in_order(written)
    assert peak == store_all(graph).peak_bytes and peak > 0


def test_leanest_file_order_sinks_a_node_that_reads_only_a_weight():
    """Shape_2 reads the embedding E (an initializer: alive anyway) and its output is read by
    Gather_0 near the end; written first, it goes back to right before Gather_0."""
    model = _tied_model()
    names = [n.name for n in model.graph.node]
    early = ["Shape_2"] + [n for n in names if n != "Shape_2"]
    _, written = _written(model, [early])
    assert written.index("Gather_0") - written.index("Shape_2") == 1, written


def test_leanest_file_order_keeps_the_first_of_equally_lean_candidates():
    """The last two nodes write graph outputs (neither moves) and run after the peak: both orders
    of them give the same peak, and the first candidate given is the one written."""
    model = _tied_model()
    names = [n.name for n in model.graph.node]
    swapped = names[:-2] + [names[-1], names[-2]]
    one = _written(model, [names])
    other = _written(model, [swapped])
    assert one[0] == other[0] and one[1] != other[1]
    assert _written(model, [names, swapped]) == one
    assert _written(model, [swapped, names]) == other


def test_leanest_file_order_names_the_problem_with_bad_candidates():
    model = _tied_model()
    names = [n.name for n in model.graph.node]
    with pytest.raises(ValueError, match=r"^each candidate order must name every node of the model once "
                                         r"\(unique names\)$"):
        leanest_file_order(model, [names[1:]])


# -- _with_exclusive_producers ----------------------------------------------------------------------

def _joined(nodes, sizes, chain=("U",), outputs=("u",)):
    from graphopt.builder.file_order import _with_exclusive_producers
    by_name = {n.name: n for n in nodes}
    readers, producer = {}, {}
    for n in nodes:
        for t in n.input:
            readers.setdefault(t, set()).add(n.name)
        for o in n.output:
            producer[o] = n.name
    return _with_exclusive_producers(list(chain), by_name, set(outputs), readers, producer, sizes)


def test_a_producer_joins_an_update_when_it_reads_no_more_than_it_makes():
    """U (the update) reads g and s. G makes g (100) from h (100, made by H from a 4-byte input)
    and a 6-byte index: it reads 106 <= 100 x (1 + 1/16), so it joins, and then H (reads 4,
    makes 100). S makes s (4) from b (400): it reads more than it makes and stays, and so does
    B behind it. R makes r, which U and another node read: it stays whatever its sizes."""
    nodes = [_node("H", ["x"], ["h"]), _node("B", ["x"], ["b"]), _node("S", ["b"], ["s"]),
             _node("G", ["h", "i"], ["g"]), _node("R", ["x"], ["r"]), _node("O", ["r"], ["o"]),
             _node("U", ["g", "s", "r"], ["u"])]
    sizes = {"h": 100, "b": 400, "s": 4, "g": 100, "i": 6, "r": 8, "x": 4, "o": 8, "u": 100}
    assert _joined(nodes, sizes) == ["H", "G", "U"]
    # a little more than the slack: G stays, and H behind it
    assert _joined(nodes, {**sizes, "i": 7}) == ["U"]
    # a node whose output is a graph output stays
    assert _joined(nodes, sizes, outputs=("u", "g")) == ["U"]
