"""The optimizer step inside the training graph (graphopt/builder/optimizer.py) and the training
loop on ONNX Runtime (graphopt/train.py), against torch.optim on the same model, data and
initial weights; the graph graphopt optimizes trains exactly like the one it was given."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")
import onnxruntime as ort  # noqa: E402

ort.set_default_logger_severity(3)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphopt_zoo.torch_zoo import ZOO, export  # noqa: E402

from graphopt.analyze import fed_back_outputs  # noqa: E402
from graphopt.builder.optimizer import OptimizerSpec  # noqa: E402
from graphopt.builder.train_graph import build_training_graph  # noqa: E402
from graphopt.errors import GraphoptError, InvalidModelError, InvalidOptionError  # noqa: E402
from graphopt.examples import example_inputs, forward_example  # noqa: E402
from graphopt.optimize import OptimizeOptions, optimize  # noqa: E402
from graphopt.train import train, with_state  # noqa: E402

STEPS = 12
BATCHES = 3


def _dataset(entry, seed=7):
    """BATCHES batches shaped like the entry's inputs (its own first), as torch tensors."""
    g = torch.Generator().manual_seed(seed)

    def more(t):
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=g, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype)

    inputs = {k: torch.cat([v] + [more(v) for _ in range(BATCHES - 1)]) for k, v in entry.inputs.items()}
    labels = torch.cat([entry.labels] + [more(entry.labels) for _ in range(BATCHES - 1)])
    return inputs, labels


def _torch_losses(entry, inputs, labels, make_optimizer):
    module = entry.module
    module.train()
    optimizer = make_optimizer(module.parameters())
    batch = next(iter(entry.inputs.values())).shape[0]
    losses = []
    for i in range(STEPS):
        start = (i % BATCHES) * batch
        out = module(*[v[start:start + batch] for v in inputs.values()])
        target = labels[start:start + batch]
        if entry.loss == "cross_entropy":
            axis = entry.class_axis if entry.class_axis is not None else (1 if out.dim() == 2 else out.dim() - 1)
            loss = torch.nn.functional.cross_entropy(out.movedim(axis, 1), target)
        else:
            loss = torch.nn.functional.mse_loss(out, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


CASES = {
    # BatchNorm in training mode, SGD with momentum and weight decay
    "resnet-sgd": ("resnet", OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "resnet-adamw": ("resnet", OptimizerSpec("adamw", lr=1e-2),
                     lambda p: torch.optim.AdamW(p, lr=1e-2)),
    # attention (a GPT with tied embeddings; a BERT-like encoder)
    "gpt-adamw": ("gpt", OptimizerSpec("adamw", lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                  lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "bert-sgd": ("bert", OptimizerSpec("sgd", lr=0.1),
                 lambda p: torch.optim.SGD(p, lr=0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_trains_like_torch_optim(case):
    name, spec, make_optimizer = CASES[case]
    entry = ZOO[name]()
    forward = export(entry)
    kwargs = {"loss": entry.loss}
    if entry.class_axis is not None:
        kwargs["class_axis"] = entry.class_axis
    model = build_training_graph(forward, optimizer=spec, **kwargs)
    onnx.checker.check_model(model)
    feedback = fed_back_outputs(model)
    outputs = [o.name for o in model.graph.output]
    assert outputs[0] == "loss" and not any(o.endswith("_grad") for o in outputs)
    assert set(outputs[1:]) == set(feedback), "every output after the loss is fed back"
    inputs, labels = _dataset(entry)
    data = {k: v.numpy() for k, v in inputs.items()}
    data["labels"] = labels.numpy()
    result = train(model, data, STEPS, threads=1)
    expected = _torch_losses(entry, inputs, labels, make_optimizer)
    relative = [abs(a - b) / abs(b) for a, b in zip(result.losses, expected)]
    assert len(result.losses) == STEPS and max(relative) <= 1e-3, list(zip(result.losses, expected))
    assert len(set(np.round(expected, 4))) > STEPS // 2, "the loss should move"
    # the parameters the exporter kept under torch's names end where torch's do
    torch_params = {k: v.detach().numpy() for k, v in entry.module.named_parameters()}
    compared = 0
    for key, value in result.state.items():
        if key in torch_params and torch_params[key].shape == value.shape:
            scale = max(float(np.abs(torch_params[key]).max()), 1e-6)
            assert float(np.abs(value - torch_params[key]).max()) / scale <= 1e-3, key
            compared += 1
    assert compared >= 4
    if spec.kind == "adamw":
        assert float(result.state["optimizer.step"]) == STEPS


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_transformers_model_trains_like_torch_optim(name):
    """A real transformers architecture (zoo/real_zoo.py, tiny), exported as users export it:
    12 AdamW steps on its batch equal torch's on the same module."""
    from graphopt_zoo import real_zoo
    model = real_zoo.CORPUS[name]("tiny")
    forward = real_zoo.export(model, "legacy")
    graph = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis,
                                 optimizer=OptimizerSpec("adamw", lr=2e-3))
    result = train(graph, real_zoo.model_feeds(model), STEPS, threads=1)
    module = real_zoo._train_mode(model.module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-3)
    expected = []
    for _ in range(STEPS):
        out = module(*model.inputs.values())
        axis = model.class_axis if model.class_axis is not None else (1 if out.dim() == 2 else out.dim() - 1)
        loss = torch.nn.functional.cross_entropy(out.movedim(axis, 1), model.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(float(loss.detach()))
    relative = [abs(a - b) / abs(b) for a, b in zip(result.losses, expected)]
    assert max(relative) <= 1e-3, list(zip(result.losses, expected))
    assert expected[-1] < 0.9 * expected[0], "12 steps on one batch should lower the loss"


def _example(name="resnet", optimizer=OptimizerSpec("adamw", lr=1e-3)):
    forward = forward_example(name, small=True)
    batches = [example_inputs(forward, seed=s) for s in range(BATCHES)]
    data = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    return build_training_graph(forward, optimizer=optimizer), data, batches[0]


@pytest.mark.parametrize("spec", [OptimizerSpec("sgd", lr=0.05, momentum=0.9), OptimizerSpec("adamw", lr=1e-3)],
                         ids=["sgd", "adamw"])
def test_the_graph_graphopt_optimizes_trains_identically(spec):
    model, data, first = _example("densenet", spec)
    result = optimize(model, OptimizeOptions(inputs=first, objective="least-peak", measure=False))
    assert result.report.outputs_match and result.report.recompute_nodes > 0
    given = train(model, data, STEPS, threads=1)
    optimized = train(result.model, data, STEPS, threads=1)
    assert optimized.losses == given.losses
    assert all(np.array_equal(optimized.state[k], given.state[k]) for k in given.state)


def test_cli_trains_logs_and_resumes(tmp_path):
    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "graphopt.cli", *map(str, args)], capture_output=True,
                              text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    cli("example", "mlp", "--small", "--batches", BATCHES, "-o", ".")
    forward = forward_example("mlp", small=True)
    from graphopt.inputs import load_inputs
    data = load_inputs(tmp_path / "mlp.data.npz")
    batch = example_inputs(forward, seed=1)     # the example's batch 1 is rows B..2B of its data
    assert all(np.array_equal(data[k][len(v):2 * len(v)], v) for k, v in batch.items())
    np.savez(tmp_path / "data.npz", **{k: data[k] for k in batch})   # the plain-npz form
    out = cli("train-graph", "mlp.onnx", "-o", "train.onnx", "--optimizer", "adamw", "--lr", "1e-3",
              "--betas", "0.85,0.995", "--weight-decay", "0.05")
    assert "adamw step inside" in out
    cli("train", "train.onnx", "--data", "data.npz", "--steps", 9, "--log", "nine.csv", "-q")
    cli("train", "train.onnx", "--data", "data.npz", "--steps", 6, "--log", "six.csv", "--out", "six.onnx", "-q")
    cli("train", "six.onnx", "--data", "data.npz", "--steps", 3, "--log", "resumed.csv", "-q")
    rows = {name: list(csv.reader(open(tmp_path / f"{name}.csv"))) for name in ("nine", "six", "resumed")}
    assert rows["nine"][0] == ["step", "loss"] and [r[0] for r in rows["nine"][1:]] == [str(i) for i in range(1, 10)]
    nine = [float(r[1]) for r in rows["nine"][1:]]
    assert [float(r[1]) for r in rows["six"][1:]] == nine[:6]
    # resumed from --out: steps 7-9 exactly (the step count came back with the weights, so
    # the bias corrections go on; its batches start again at row 0, which step 7 also reads)
    assert [float(r[1]) for r in rows["resumed"][1:]] == nine[6:]
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "six.onnx").graph.initializer}
    assert float(trained["optimizer.step"]) == 6


def test_training_refuses_what_it_cannot_do(tmp_path):
    model, data, _ = _example("mlp")
    with pytest.raises(InvalidOptionError, match="not a multiple of the batch size"):
        train(model, {k: v[:-1] for k, v in data.items()}, 1)
    with pytest.raises(InvalidOptionError, match="no arrays for the graph's inputs"):
        train(model, {k: v for k, v in data.items() if k != "labels"}, 1)
    plain = build_training_graph(forward_example("mlp", small=True))
    with pytest.raises(InvalidModelError, match="train-graph --optimizer"):
        train(plain, data, 1)
    for spec, message in [(OptimizerSpec("adam", lr=1), "unknown optimizer"),
                          (OptimizerSpec("sgd", lr=0), "learning rate"),
                          (OptimizerSpec("sgd", lr=1, momentum=1.5), "momentum"),
                          (OptimizerSpec("adamw", lr=1, betas=(0.9, 1.0)), "betas")]:
        with pytest.raises(InvalidOptionError, match=message):
            build_training_graph(forward_example("mlp", small=True), optimizer=spec)
    done = subprocess.run([sys.executable, "-m", "graphopt.cli", "train-graph", "x.onnx", "-o", "y.onnx",
                           "--momentum", "0.9"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and "--momentum needs --optimizer" in done.stderr
    assert issubclass(InvalidOptionError, GraphoptError)


def test_trained_defaults_replace_only_the_state():
    model, data, _ = _example("mlp", OptimizerSpec("sgd", lr=0.1))
    result = train(model, data, 2, threads=1)
    resumed = with_state(model, result.state)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in resumed.graph.initializer}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and changed <= set(result.state)
    assert [n.name for n in resumed.graph.node] == [n.name for n in model.graph.node]


def test_fused_step_frees_each_gradient_measured(tmp_path):
    """On a model whose weights dominate, the fused step's measured peak is far below the plain
    step's (every gradient an output, all alive at the end) and within plain + 0.5 x gradient
    bytes; the cost model, which counts the fed-back outputs as the trainer's own buffers,
    predicts the three peaks within 5% of the measurement, or 512 KiB (a few pages of noise)
    for the smallest (one measuring process per graph)."""
    from graphopt.analyze import analyze
    from graphopt.costmodel import simulate
    from graphopt.inputs import save_inputs
    from graphopt.op_rules import build_cost_graph
    from graphopt.runtime.measure import measure
    from graphopt.annotate import annotate
    from graphopt.runtime.session import read_settings

    forward = forward_example("mlp", batch=8, width=1024, depth=6, d_in=1024)
    feeds = example_inputs(forward)
    save_inputs(tmp_path / "inputs.npz", feeds)
    gradient_bytes = sum(int(np.prod(t.dims)) * 4 for t in forward.graph.initializer
                         if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1)
    peaks, predicted = {}, {}
    for label, spec in [("plain", None), ("sgd", OptimizerSpec("sgd", lr=0.1, momentum=0.9)),
                        ("adamw", OptimizerSpec("adamw", lr=1e-3))]:
        model = build_training_graph(forward, optimizer=spec)
        onnx.save(model, tmp_path / f"{label}.onnx")
        peaks[label] = measure(tmp_path / f"{label}.onnx", tmp_path / "inputs.npz", timing=False).peak_bytes
        training = analyze(model)
        annotations = annotate(model, feeds, read_settings(model))
        graph = build_cost_graph(training, annotations.tensor_bytes, annotations.node_seconds)
        predicted[label] = simulate(graph, [(n, 0) for n in annotations.execution_order if n in graph]).peak_bytes
    assert peaks["plain"] >= gradient_bytes                    # the gradients are all there
    assert peaks["sgd"] <= 0.5 * peaks["plain"], peaks
    assert peaks["adamw"] <= peaks["plain"] + 0.5 * gradient_bytes and peaks["adamw"] < peaks["plain"], peaks
    for label in peaks:
        assert abs(predicted[label] - peaks[label]) <= max(0.05 * peaks[label], 512 * 1024), (label, predicted, peaks)


def test_dropout_draws_a_new_mask_every_step_of_a_run():
    """ONNX Runtime's random kernels advance their generator on every run of a session, so the
    Dropout masks of one `train` run differ from step to step (the parameters barely move:
    lr 1e-9, one batch, so the loss changes with the mask alone), and a new run (a new
    session) draws the same sequence again."""
    entry = ZOO["dropout_mlp"]()
    forward = export(entry)
    model = build_training_graph(forward, loss=entry.loss, optimizer=OptimizerSpec("sgd", lr=1e-9))
    data = {k: v.numpy() for k, v in entry.inputs.items()}
    data["labels"] = entry.labels.numpy()
    first = train(model, data, 6, threads=1).losses
    again = train(model, data, 6, threads=1).losses
    assert len(set(np.round(first, 6))) >= 5, first
    assert first == again
