"""The example zoo: every model builds into a valid, runnable training graph."""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from graphopt.runtime.session import open_session
from graphopt.examples import EXAMPLES, forward_example, example_inputs, training_example


def _session(model):
    # one thread: ScatterND(add) is wrong with more (ort-facts 6)
    return open_session(model, threads=1)


def test_names():
    assert EXAMPLES == ["mlp", "resnet", "densenet", "unet", "transformer", "randwire"]
    with pytest.raises(KeyError):
        forward_example("nope")


@pytest.mark.parametrize("name", EXAMPLES)
def test_small_example_builds_and_runs(name):
    train, feeds = training_example(name, small=True)
    onnx.checker.check_model(train, full_check=True)
    names = [n.name for n in train.graph.node]
    assert all(names) and len(set(names)) == len(names)
    params = {t.name: tuple(t.dims) for t in train.graph.initializer}
    outputs = [o.name for o in train.graph.output]
    assert outputs[0] == "loss"
    assert len(outputs) > 1
    results = _session(train).run(None, feeds)
    assert np.shape(results[0]) == () and np.isfinite(results[0])
    for out, value in zip(outputs[1:], results[1:]):
        assert out.endswith("_grad")
        assert value.shape == params[out[:-len("_grad")]], out
        assert np.isfinite(value).all(), out
    assert all(np.any(value) for value in results[1:] if value.size > 1)
    # every float initializer of the forward that is a weight gets a gradient
    forward = forward_example(name, small=True)
    weights = {t.name for t in forward.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1
               and not t.name.startswith("c_")}
    assert {o[:-len("_grad")] for o in outputs[1:]} == weights


def test_deterministic():
    a, fa = training_example("randwire", small=True)
    b, fb = training_example("randwire", small=True)
    assert a.SerializeToString() == b.SerializeToString()
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)


def _loss(forward, feeds, overrides):
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    for tensor in model.graph.initializer:
        if tensor.name in overrides:
            tensor.CopyFrom(numpy_helper.from_array(overrides[tensor.name], tensor.name))
    return float(_session(model).run(["loss"], feeds)[0])


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_directional_derivative_matches_finite_differences(name):
    """<grad, v> against a central difference of the forward loss along a random v.

    Only the smooth models (tanh, Gelu, Softmax, LayerNorm): Relu kinks and MaxPool ties
    make float32 finite differences of the CNNs too noisy; `test_resnet_matches_torch`
    covers those rules instead."""
    forward = forward_example(name, small=True)
    train, feeds = training_example(name, small=True)
    outputs = [o.name for o in train.graph.output]
    grads = dict(zip(outputs, _session(train).run(None, feeds)))
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64)
               for t in forward.graph.initializer if t.name + "_grad" in grads}
    rng = np.random.default_rng(7)
    direction = {k: rng.standard_normal(v.shape) for k, v in weights.items()}
    predicted = sum(float((grads[k + "_grad"] * direction[k]).sum()) for k in weights)
    step = 1e-3
    plus = _loss(forward, feeds, {k: (w + step * direction[k]).astype(np.float32)
                                  for k, w in weights.items()})
    minus = _loss(forward, feeds, {k: (w - step * direction[k]).astype(np.float32)
                                   for k, w in weights.items()})
    measured = (plus - minus) / (2 * step)
    assert abs(measured - predicted) <= 2e-2 * max(abs(predicted), 1e-2), (measured, predicted)


def test_mlp_matches_torch():
    torch = pytest.importorskip("torch")
    forward = forward_example("mlp", small=True)
    train, feeds = training_example("mlp", small=True)
    outputs = [o.name for o in train.graph.output]
    results = dict(zip(outputs, _session(train).run(None, feeds)))
    weights = {t.name: torch.tensor(numpy_helper.to_array(t), dtype=torch.float64,
                                    requires_grad=True)
               for t in forward.graph.initializer if t.name + "_grad" in results}
    h = torch.tensor(feeds["x"], dtype=torch.float64)
    layer = 0
    while "fc%d.weight" % layer in weights:
        h = torch.tanh(h @ weights["fc%d.weight" % layer].T + weights["fc%d.bias" % layer])
        layer += 1
    logits = h @ weights["head.weight"].T + weights["head.bias"]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["labels"]))
    loss.backward()
    assert abs(loss.item() - float(results["loss"])) < 1e-5
    for name, tensor in weights.items():
        expected = tensor.grad.numpy()
        error = np.abs(results[name + "_grad"] - expected).max() / np.abs(expected).max()
        assert error <= 1e-3, name


def test_inputs_are_valid():
    for name in EXAMPLES:
        forward = forward_example(name, small=True)
        feeds = example_inputs(forward)
        assert set(feeds) == {i.name for i in forward.graph.input}
        if name == "transformer":
            vocab = next(t.dims[0] for t in forward.graph.initializer
                         if t.name == "embed.weight")
            assert feeds["tokens"].max() < vocab


def test_resnet_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    forward = forward_example("resnet", small=True)
    train, feeds = training_example("resnet", small=True)
    outputs = [o.name for o in train.graph.output]
    results = dict(zip(outputs, _session(train).run(None, feeds)))
    w = {t.name: torch.tensor(numpy_helper.to_array(t), dtype=torch.float64,
                              requires_grad=True)
         for t in forward.graph.initializer if t.name + "_grad" in results}

    def conv(h, name, stride=1, k=3):
        return F.conv2d(h, w[name + ".weight"], w.get(name + ".bias"), stride=stride,
                        padding=k // 2)

    h = F.relu(conv(torch.tensor(feeds["x"], dtype=torch.float64), "stem"))
    channels = w["stem.weight"].shape[0]
    stage = 0
    while "s%d.b0.conv1.weight" % stage in w:
        block = 0
        while "s%d.b%d.conv1.weight" % (stage, block) in w:
            name = "s%d.b%d" % (stage, block)
            stride = 2 if (block == 0 and stage > 0) else 1
            y = conv(F.relu(conv(h, name + ".conv1", stride)), name + ".conv2")
            shortcut = conv(h, name + ".proj", stride, k=1) if name + ".proj.weight" in w \
                else h
            h = F.relu(y + shortcut)
            block += 1
        stage += 1
    logits = h.mean(dim=(2, 3)) @ w["head.weight"].T + w["head.bias"]
    loss = F.cross_entropy(logits, torch.tensor(feeds["labels"]))
    loss.backward()
    assert abs(loss.item() - float(results["loss"])) < 1e-5
    for name, tensor in w.items():
        expected = tensor.grad.numpy()
        error = np.abs(results[name + "_grad"] - expected).max() / np.abs(expected).max()
        assert error <= 1e-3, name
