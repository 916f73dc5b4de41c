"""graphopt's training-graph builder against torch autograd, on the torch model zoo
(zoo/torch_zoo.py: twelve architectures exported without their loss, in eval form).

For every architecture: export -> build_training_graph(loss kind) -> onnx.checker ->
ONNX Runtime on CPU with 1 and with 4 intra-op threads (4 catches ScatterND(add)'s race on
repeated embedding indices, ort-facts.md section 6) -> compared with the module in TRAIN
mode under torch autograd: the loss, every parameter's gradient, BatchNorm's updated running
statistics. Then the training graph goes through graphopt's pipeline, outputs compared.

Error measure: max|x - x_torch| / max|x_torch| <= 1e-3 for the loss and the gradients. A
gradient that is zero in exact arithmetic (the attention keys' bias: softmax ignores a shift
common to a row) is rounding noise in both, so its denominator is floored at 1e-3 x the
largest gradient of the model. The updated BatchNorm statistics are one reduction away from
the data (about 1e-7 apart when right), and what goes wrong with them is small: biased
instead of unbiased variance changes them by momentum/(n-1), 8e-4 at n = 128 values per
channel; so they are held to 1e-5.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)   # no warning per overridable initializer
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphopt_zoo.torch_zoo import ZOO, ZooEntry, export, op_types  # noqa: E402

from graphopt.builder.train_graph import build_training_graph  # noqa: E402
from graphopt.errors import UnsupportedOpError  # noqa: E402
from graphopt.optimize import OptimizeOptions, optimize  # noqa: E402

F = torch.nn.functional
TOL = 1e-3
STAT_TOL = 1e-5
THREADS = (1, 2, 4)   # 2 as well: on this 2-core machine the race showed in 10 of 10 runs with 2 threads, 3 of 10 with 4
NAMES = list(ZOO)
# operators each forward must contain (the zoo is real in structure)
EXPECTED_OPS = {
    "mlp": {"Gemm", "Relu", "Tanh"},
    "vgg": {"Conv", "Relu", "MaxPool", "Gemm"},
    "resnet": {"Conv", "BatchNormalization", "Add", "GlobalAveragePool"},
    "densenet": {"Concat", "BatchNormalization", "AveragePool", "Conv"},
    "mobilenet": {"Conv", "BatchNormalization", "Clip", "HardSwish"},
    "unet": {"ConvTranspose", "Concat", "MaxPool", "Conv"},
    "lstm": {"LSTM"},
    "bert": {"Gather", "LayerNormalization", "MatMul", "Softmax", "Erf"},
    "gpt": {"Gather", "LayerNormalization", "MatMul", "Softmax", "Where"},
    "vit": {"Conv", "Concat", "LayerNormalization", "MatMul", "Softmax"},
    "dropout_mlp": {"Dropout"},
    "randwire": {"Conv", "BatchNormalization", "Add"},
    "fpn": {"Split", "Resize", "Slice", "Pad", "Concat", "LeakyRelu", "Sigmoid"},
    "convs": {"Conv", "ConvTranspose"},
    "albert": {"Gather", "LayerNormalization", "MatMul", "Softmax"},
}
RESULTS: dict[str, dict] = {}   # architecture -> worst errors, seconds (printed with -s)


# ----------------------------------------------------------------------------- helpers --

def _require_loss_api():
    """Fail clearly (not skip) while the builder lacks the loss-kind API of issue 5."""
    params = inspect.signature(build_training_graph).parameters
    missing = [p for p in ("loss", "labels", "class_axis") if p not in params]
    if missing:
        pytest.fail("build_training_graph has no %s argument(s) yet: the loss-kind API "
                    "(loss='cross_entropy'|'mse', labels=, class_axis=) of issue 5 is missing"
                    % missing)


def _build(entry: ZooEntry, forward: onnx.ModelProto) -> onnx.ModelProto:
    _require_loss_api()
    kwargs = {"loss": entry.loss}
    if entry.class_axis is not None:
        kwargs["class_axis"] = entry.class_axis
    return build_training_graph(forward, **kwargs)


@functools.lru_cache(maxsize=None)
def _built(name: str):
    """(forward, training graph, build seconds) of zoo entry `name`, built once per session."""
    entry = ZOO[name]()
    forward = export(entry)
    started = time.perf_counter()
    train = _build(entry, forward)
    return forward, train, time.perf_counter() - started


def _feeds(entry: ZooEntry) -> dict[str, np.ndarray]:
    feeds = {k: v.detach().numpy() for k, v in entry.inputs.items()}
    labels = entry.labels.detach().numpy()
    feeds["labels"] = labels.astype(np.int64 if entry.loss == "cross_entropy" else np.float32)
    return feeds


def _run_ort(model: onnx.ModelProto, feeds, threads: int) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _rel(value: np.ndarray, expected: np.ndarray, floor: float = 0.0) -> float:
    value, expected = np.asarray(value, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.abs(expected).max()) if expected.size else 0.0, floor)
    diff = float(np.abs(value - expected).max()) if expected.size else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _classify_outputs(forward: onnx.ModelProto, train: onnx.ModelProto):
    """Split the training graph's outputs: loss, gradients (param -> output name), updated
    BatchNorm statistics (stat initializer -> output name), Dropout masks (names)."""
    initializers = {t.name for t in forward.graph.initializer}
    outputs = list(train.graph.output)
    assert outputs and outputs[0].name == "loss", \
        "the first output must be 'loss', got %s" % [o.name for o in outputs[:3]]
    grads, stats, masks, unknown = {}, {}, [], []
    for o in outputs[1:]:
        elem = o.type.tensor_type.elem_type
        if o.name.endswith("_grad") and o.name[:-len("_grad")] in initializers:
            grads[o.name[:-len("_grad")]] = o.name
        elif o.name.endswith("_updated") and o.name[:-len("_updated")] in initializers:
            stats[o.name[:-len("_updated")]] = o.name
        elif elem == TensorProto.BOOL:
            masks.append(o.name)
        else:
            unknown.append(o.name)
    assert not unknown, "outputs that are neither a gradient, an updated statistic nor a " \
        "Dropout mask: %s" % unknown
    return grads, stats, masks


def _match_parameters(module, forward, grads):
    """torch parameter name -> (ONNX parameter, layout "same" | "transpose").

    By name first, else by value (the initializer equals the parameter or its transpose).
    Every torch parameter with requires_grad matches exactly one gradient output, and no
    gradient output is left without a torch parameter."""
    values = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    buffers = dict(module.named_buffers())
    matched, owner = {}, {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if name in grads:
            assert tuple(values[name].shape) == tuple(param.shape), (name, values[name].shape)
            found = [(name, "same")]
        else:
            p = param.detach().numpy()
            found = []
            for onnx_name in grads:
                v = values[onnx_name]
                if v.shape == p.shape and np.array_equal(v, p):
                    found.append((onnx_name, "same"))
                elif p.ndim == 2 and v.shape == p.T.shape and np.array_equal(v, p.T):
                    found.append((onnx_name, "transpose"))
        assert len(found) == 1, (
            "torch parameter %r matches %d gradient outputs (%s); gradient outputs: %s"
            % (name, len(found), found, sorted(grads)))
        onnx_name = found[0][0]
        assert onnx_name not in owner, (
            "gradient %r matched by torch parameters %r and %r (the exporter merged equal "
            "initializers?)" % (grads[onnx_name], owner[onnx_name], name))
        owner[onnx_name] = name
        matched[name] = found[0]
    extra = sorted(set(grads) - set(owner))
    assert not extra, "gradient outputs for initializers that are no torch parameter: %s%s" % (
        [grads[e] for e in extra],
        " (torch buffers, not trainable)" if any(e in buffers for e in extra) else "")
    return matched


def _match_statistics(module, forward, stats):
    """torch BatchNorm buffer name -> ONNX `<initializer>_updated` output; every running
    mean and variance of every BatchNorm module must have one."""
    values = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    wanted = {}
    for mod_name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            for stat in ("running_mean", "running_var"):
                full = "%s.%s" % (mod_name, stat) if mod_name else stat
                wanted[full] = getattr(m, stat).detach().clone().numpy()
    matched = {}
    for full, before in wanted.items():
        if full in stats:
            matched[full] = stats[full]
            continue
        found = [s for s in stats if values[s].shape == before.shape and np.array_equal(values[s], before)]
        assert len(found) == 1, "BatchNorm statistic %r matches %d updated outputs %s (have %s)" % (
            full, len(found), found, sorted(stats.values()))
        matched[full] = stats[found[0]]
    extra = set(stats) - {s[:-len("_updated")] for s in matched.values()}
    assert not extra, "updated statistics outputs for no torch BatchNorm: %s" % sorted(extra)
    return matched


def _order_masks(train, masks, module):
    """The Dropout masks in the order of the torch module's Dropout layers (told apart by
    shape: the zoo's Dropout model gives each Dropout a different width)."""
    shapes = {o.name: tuple(d.dim_value for d in o.type.tensor_type.shape.dim)
              for o in train.graph.output}
    return sorted(masks, key=lambda m: -shapes[m][-1])   # drop1 (24 wide) before drop2 (12)


def _torch_step(entry: ZooEntry, masks: list[np.ndarray] | None):
    module = entry.module
    module.train()
    module.zero_grad()
    if masks is not None:
        module.masks = [torch.from_numpy(m.copy()) for m in masks]
    out = module(*entry.inputs.values())
    if entry.loss == "cross_entropy":
        axis = entry.class_axis if entry.class_axis is not None else (1 if out.dim() == 2 else out.dim() - 1)
        loss = F.cross_entropy(out.movedim(axis, 1), entry.labels)
    else:
        loss = F.mse_loss(out, entry.labels)
    loss.backward()
    return float(loss.detach())


# ------------------------------------------------------------------------------- tests --

@pytest.mark.parametrize("name", NAMES)
def test_zoo_forward_is_real(name):
    """Each exported forward holds the operators its architecture is about, one output
    `logits` and no loss; the GPT's token ids repeat."""
    entry = ZOO[name]()
    forward = export(entry)
    onnx.checker.check_model(forward)
    ops = op_types(name, forward)
    assert EXPECTED_OPS[name] <= ops, (name, EXPECTED_OPS[name] - ops)
    assert [o.name for o in forward.graph.output] == ["logits"]
    assert [i.name for i in forward.graph.input] == list(entry.inputs)
    if name == "mobilenet":
        assert any(n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute)
                   for n in forward.graph.node), "no depthwise Conv"
    if name == "gpt":
        assert entry.notes["repeated_ids"] > 0
    if name == "dropout_mlp":
        assert sum(n.op_type == "Dropout" for n in forward.graph.node) == 2
    if name in ("resnet", "densenet", "mobilenet", "randwire"):
        # eval form: BatchNormalization without its training outputs; ONNX momentum is
        # 1 - torch's
        bns = [n for n in forward.graph.node if n.op_type == "BatchNormalization"]
        assert bns and all(len([o for o in n.output if o]) == 1 for n in bns)
        for n in bns:
            momentum = next(a.f for a in n.attribute if a.name == "momentum")
            assert abs(momentum - (1 - 0.1)) < 1e-6, (n.name, momentum)


@pytest.mark.parametrize("name", NAMES)
def test_builder_matches_torch(name):
    started = time.perf_counter()
    forward, train, build_seconds = _built(name)
    onnx.checker.check_model(train)
    entry = ZOO[name]()          # fresh and deterministic: the values the export holds
    feeds = _feeds(entry)
    # inputs without an initializer (the ones a caller must feed): the data, then labels;
    # an input that has an initializer (a BatchNorm statistic, overridable) is optional
    overridable = {t.name for t in train.graph.initializer}
    assert [i.name for i in train.graph.input if i.name not in overridable] == \
        list(entry.inputs) + ["labels"]
    grads, stats, mask_names = _classify_outputs(forward, train)
    params = _match_parameters(entry.module, forward, grads)
    stat_outputs = _match_statistics(entry.module, forward, stats)
    n_dropout = sum(isinstance(m, torch.nn.Dropout) for m in entry.module.modules())
    assert len(mask_names) == (n_dropout if entry.training_export else 0), mask_names

    runs = {threads: _run_ort(train, feeds, threads) for threads in THREADS}
    masks = None
    if mask_names:
        ordered = _order_masks(train, mask_names, entry.module)
        masks = [runs[1][m] for m in ordered]
        for m in ordered:
            np.testing.assert_array_equal(runs[1][m], runs[4][m],
                                          err_msg="Dropout mask %s differs between 1 and 4 threads" % m)
        assert all(0 < m.mean() < 1 for m in masks), "degenerate Dropout mask"

    torch_loss = _torch_step(entry, masks)
    torch_grads = {}
    for name_t, (onnx_name, layout) in params.items():
        g = dict(entry.module.named_parameters())[name_t].grad
        assert g is not None, "torch gives no gradient for %s" % name_t
        g = g.detach().numpy()
        torch_grads[name_t] = (g.T if layout == "transpose" else g, grads[onnx_name])
    overall = max(float(np.abs(g).max()) for g, _ in torch_grads.values())
    assert overall > 0
    torch_stats = {full: (dict(entry.module.named_buffers())[full].detach().numpy(), out)
                   for full, out in stat_outputs.items()}

    worst = {}
    failures = []
    for threads, results in runs.items():
        loss_err = abs(float(results["loss"]) - torch_loss) / abs(torch_loss)
        worst_grad = ("", 0.0)
        if loss_err > TOL:
            failures.append("%d thread(s): loss %.7g vs torch %.7g (relative error %.3g)"
                            % (threads, float(results["loss"]), torch_loss, loss_err))
        for name_t, (expected, out) in torch_grads.items():
            value = results[out]
            if value.shape != expected.shape:
                failures.append("%d thread(s): %s has shape %s, torch %s"
                                % (threads, out, value.shape, expected.shape))
                continue
            err = _rel(value, expected, floor=1e-3 * overall)
            if err > worst_grad[1]:
                worst_grad = (out, err)
            if err > TOL:
                failures.append("%d thread(s): gradient %s (torch %s) relative error %.3g"
                                % (threads, out, name_t, err))
        worst_stat = ("", 0.0)
        for full, (expected, out) in torch_stats.items():
            err = _rel(results[out], expected)
            if err > worst_stat[1]:
                worst_stat = (out, err)
            if err > STAT_TOL:
                failures.append("%d thread(s): running statistic %s (torch %s) relative error "
                                "%.3g" % (threads, out, full, err))
        worst[threads] = {"loss": loss_err, "grad": worst_grad, "stat": worst_stat}
    RESULTS.setdefault(name, {}).update(worst=worst, build_seconds=build_seconds,
                                        seconds=time.perf_counter() - started,
                                        gradients=len(torch_grads), statistics=len(torch_stats))
    worst_thread = max(worst, key=lambda t: worst[t]["grad"][1])
    print("\n%-12s loss %.2g | worst gradient %s: %s | worst statistic %.2g | build %.1fs, test %.1fs"
          % (name, max(w["loss"] for w in worst.values()), worst[worst_thread]["grad"][0],
             ", ".join("%.2g (%d thr)" % (worst[t]["grad"][1], t) for t in THREADS),
             max(w["stat"][1] for w in worst.values()), build_seconds, time.perf_counter() - started))
    assert not failures, "%s: %d mismatches against torch:\n  %s" % (
        name, len(failures), "\n  ".join(failures[:20]))


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_keeps_outputs(name):
    """The training graph goes through graphopt's pipeline (a cheap strategy) and the
    rewritten graph's outputs, Dropout masks included, equal the original's."""
    forward, train, _ = _built(name)
    entry = ZOO[name]()
    started = time.perf_counter()
    result = optimize(train, OptimizeOptions(inputs=_feeds(entry), measure=False, strategy="chen-sqrt"))
    assert result.report.outputs_match is True
    assert [o.name for o in result.model.graph.output] == [o.name for o in train.graph.output]
    RESULTS.setdefault(name, {})["pipeline_seconds"] = time.perf_counter() - started


@pytest.mark.parametrize("name", ["resnet", "gpt", "dropout_mlp"])
def test_pipeline_default_strategy(name):
    forward, train, _ = _built(name)
    result = optimize(train, OptimizeOptions(inputs=_feeds(ZOO[name]()), measure=False))
    assert result.report.outputs_match is True


def _with_custom_op(forward: onnx.ModelProto) -> onnx.ModelProto:
    """`forward` with a custom-domain operator after its first node, on the loss's path."""
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    first = model.graph.node[0]
    original = first.output[0]
    first.output[0] = original + "_pre"
    custom = helper.make_node("Mystery", [original + "_pre"], [original], name="mystery_node",
                              domain="com.example")
    nodes = list(model.graph.node)
    nodes.insert(1, custom)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


def test_custom_op_on_the_loss_path_is_unsupported():
    _require_loss_api()
    entry = ZOO["mlp"]()
    forward = _with_custom_op(export(entry))
    with pytest.raises(UnsupportedOpError) as info:
        build_training_graph(forward, loss="cross_entropy")
    message = str(info.value)
    assert "Mystery" in message and "mystery_node" in message, message


def test_op_coverage_helper():
    from graphopt_zoo.torch_zoo import op_coverage
    coverage = op_coverage(["mlp", "unet"])
    assert coverage["mlp"] == ["Gemm", "Relu", "Tanh"]
    assert "ConvTranspose" in coverage["unet"]


def _linear_with_transposed_weight():
    """A torch Linear and a hand-written ONNX forward holding its weight transposed under an
    exporter-style name (MatMul(x, W^T) + b), as exporters do for some layouts."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 4))
    w, b = module[0].weight.detach().numpy(), module[0].bias.detach().numpy()
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "0.bias"], ["logits"], name="add")]
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 4])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "onnx::MatMul_7"),
         numpy_helper.from_array(b, "0.bias")])
    return module, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_parameters_are_matched_by_value_and_transposed():
    module, forward = _linear_with_transposed_weight()
    grads = {"onnx::MatMul_7": "onnx::MatMul_7_grad", "0.bias": "0.bias_grad"}
    assert _match_parameters(module, forward, grads) == {
        "0.weight": ("onnx::MatMul_7", "transpose"), "0.bias": ("0.bias", "same")}
    with pytest.raises(AssertionError, match="0.weight"):       # a parameter without gradient
        _match_parameters(module, forward, {"0.bias": "0.bias_grad"})
    with pytest.raises(AssertionError, match="no torch parameter"):   # a gradient without parameter
        _match_parameters(torch.nn.Sequential(), forward, grads)


def test_transposed_weight_gradient_matches_torch():
    """The same comparison as the zoo's, end to end, for a parameter held transposed."""
    _require_loss_api()
    module, forward = _linear_with_transposed_weight()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 3, 1])
    train = build_training_graph(forward, loss="cross_entropy")
    grads, _, _ = _classify_outputs(forward, train)
    matched = _match_parameters(module, forward, grads)
    results = _run_ort(train, {"x": x.numpy(), "labels": labels.numpy()}, 1)
    loss = F.cross_entropy(module(x), labels)
    loss.backward()
    assert abs(float(results["loss"]) - float(loss)) <= TOL * abs(float(loss))
    for name, (onnx_name, layout) in matched.items():
        g = dict(module.named_parameters())[name].grad.numpy()
        assert _rel(results[grads[onnx_name]], g.T if layout == "transpose" else g) <= TOL, name
