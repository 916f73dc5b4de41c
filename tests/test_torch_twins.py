"""The PyTorch twins of the example zoo (zoo/torch_twins.py) compute the ONNX forward
model's loss and the graphopt training graph's gradients, from the same parameters."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from graphopt_zoo.torch_twins import TWINS, twin_example, torch_inputs  # noqa: E402

from graphopt.builder.train_graph import build_training_graph  # noqa: E402
from graphopt.examples import EXAMPLES, training_example  # noqa: E402
from graphopt.runtime.session import open_session  # noqa: E402


def _torch_step(name, **size):
    module, forward, inputs = twin_example(name, **size)
    loss = module(*torch_inputs(module, inputs))
    loss.backward()
    return module, forward, inputs, float(loss.detach())


def _check(name, grad_tol, **size):
    module, forward, inputs, loss = _torch_step(name, **size)

    # the loss of the ONNX forward model in ONNX Runtime
    ort_loss = float(open_session(forward, threads=1).run(["loss"], inputs)[0])
    assert abs(loss - ort_loss) <= 1e-4 * abs(ort_loss), (name, loss, ort_loss)

    # the gradients of graphopt's training graph (one thread: ScatterND(add), ort-facts 6)
    train = build_training_graph(forward)
    outs = [o.name for o in train.graph.output]
    results = dict(zip(outs, open_session(train, threads=1).run(None, inputs)))
    params = module.onnx_parameters()
    assert sorted(outs[1:]) == sorted(p + "_grad" for p in params)
    assert abs(float(results["loss"]) - loss) <= 1e-4 * abs(loss)
    grads = {p: t.grad.detach().numpy() for p, t in params.items()}
    overall = max(float(np.abs(g).max()) for g in grads.values())
    assert overall > 0
    for p, expected in grads.items():
        value = results[p + "_grad"]
        assert value.shape == expected.shape, p
        # a gradient that is zero in exact arithmetic (the attention keys' bias: softmax
        # ignores a shift common to a row) is rounding noise in both: compare it on the
        # scale of the model's gradients
        scale = max(float(np.abs(expected).max()), 1e-3 * overall)
        err = float(np.abs(value - expected).max()) / scale
        assert err <= grad_tol, (name, p, err)


def test_every_example_has_a_twin():
    assert sorted(TWINS) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_small_twin_matches_onnx(name):
    _check(name, 1e-4, small=True)


def test_default_size_transformer_twin_matches_onnx():
    _check("transformer", 1e-3)


def test_twin_inputs_are_the_training_examples():
    module, forward, inputs = twin_example("randwire", small=True)
    _, train_inputs = training_example("randwire", small=True)
    assert sorted(inputs) == sorted(train_inputs)
    for k in inputs:
        np.testing.assert_array_equal(inputs[k], train_inputs[k])
    assert [t.shape for t in torch_inputs(module, inputs)] == \
        [inputs[n].shape for n in module.input_names]


def test_a_changed_parameter_changes_the_loss():
    """The check is not vacuous: the twin really reads the ONNX model's parameters."""
    module, forward, inputs = twin_example("resnet", small=True)
    ort_loss = float(open_session(forward, threads=1).run(["loss"], inputs)[0])
    with torch.no_grad():
        module.onnx_parameters()["s1.b0.conv2.weight"].mul_(1.5)
    loss = float(module(*torch_inputs(module, inputs)).detach())
    assert abs(loss - ort_loss) > 1e-4 * abs(ort_loss)


def test_randwire_wiring_is_read_from_the_graph():
    module, forward, _ = twin_example("randwire", small=True)
    sums = [n for n in forward.graph.node if n.op_type == "Sum"]
    assert sum(len(p) > 1 for p in module.preds) == len(sums)
    for i, preds in enumerate(module.preds):
        assert all(p <= i for p in preds)  # output i is cell i-1 (0: the stem)


def test_compare_harness_measures_what_the_step_holds():
    """benchmarks/pytorch_compare.py's eager worker (a fresh, mmap-allocator process, like
    graphopt's ORT measurement) on the default mlp: at the start of the backward pass the
    16 tanh outputs [1536, 512] are all saved, and at the end all gradients are live, so the
    measured peak is at least either; and the step is not charged for the resident
    parameters and inputs, or much else."""
    import pytorch_compare

    r = pytorch_compare._run_worker("mlp", "eager", 1, timeout=300)
    module, forward, inputs = twin_example("mlp")
    saved = 16 * 1536 * 512 * 4
    grads = sum(p.numel() * 4 for p in module.parameters())
    assert r["grads_bytes"] == grads
    assert r["peak_bytes"] >= max(saved, grads)
    assert r["peak_bytes"] <= 2 * (saved + grads)
    ort_loss = float(open_session(forward, threads=1).run(["loss"], inputs)[0])
    assert abs(r["loss"] - ort_loss) <= 1e-4 * abs(ort_loss)
