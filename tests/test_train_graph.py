"""build_training_graph against torch autograd, and its error cases."""
import io

import numpy as np
import onnx
import pytest

from graphopt.runtime.session import open_session
from onnx import TensorProto, helper, numpy_helper

from graphopt.build.train_graph import build_training_graph
from graphopt.errors import InvalidModelError, UnsupportedOpError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
nn = torch.nn
F = torch.nn.functional


def _export(module, args, input_names):
    buffer = io.BytesIO()
    module.eval()
    torch.onnx.export(module, args, buffer, input_names=input_names, output_names=["loss"],
                      dynamo=False, opset_version=17, do_constant_folding=False)
    return onnx.load_from_string(buffer.getvalue())


def _session(model):
    # one thread: ScatterND(add) is wrong with more (ort-facts 6)
    return open_session(model, threads=1)


def _check_against_torch(module, args, input_names, tol=1e-3):
    forward = _export(module, args, input_names)
    train = build_training_graph(forward)
    onnx.checker.check_model(train, full_check=True)
    names = [n.name for n in train.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert [i.name for i in train.graph.input] == input_names

    params = dict(module.named_parameters())
    outputs = [o.name for o in train.graph.output]
    assert outputs[0] == "loss"
    grads = outputs[1:]
    assert sorted(grads) == sorted(p + "_grad" for p in params)
    init = {t.name: numpy_helper.to_array(t) for t in train.graph.initializer}

    results = _session(train).run(None, {n: a.numpy() for n, a in zip(input_names, args)})
    module.zero_grad()
    loss = module(*args)
    loss.backward()
    assert np.allclose(results[0], loss.item(), rtol=1e-4, atol=1e-5)
    for name, value in zip(grads, results[1:]):
        param = params[name[:-len("_grad")]]
        expected = param.grad.detach().numpy()
        assert value.shape == expected.shape, name
        np.testing.assert_allclose(init[name[:-len("_grad")]], param.detach().numpy())
        scale = np.abs(expected).max()
        assert scale > 0, name
        assert np.abs(value - expected).max() / scale <= tol, name
    return train


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 7)

    def forward(self, x, labels):
        h = torch.tanh(self.l1(x))
        h = F.relu(self.l2(h))
        return F.cross_entropy(self.l3(h), labels)


class ResCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.c1 = nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x, labels):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.c2(F.relu(self.c1(h))))
        h = self.pool(F.relu(self.down(h)))
        h = h.mean(dim=(2, 3))
        return F.cross_entropy(self.fc(h), labels)


class Attention(nn.Module):
    def __init__(self, vocab=13, d=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff = nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, tokens, target):
        b, t = tokens.shape
        x = self.emb(tokens)
        h = self.ln(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        split = lambda z: z.reshape(b, t, self.heads, -1).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)
        ctx = (attn @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(ctx)
        y = self.ff(F.gelu(x))
        return ((y - target) ** 2).mean()


def test_mlp_cross_entropy_matches_torch():
    torch.manual_seed(0)
    module = MLP()
    args = (torch.randn(16, 12), torch.randint(0, 7, (16,)))
    _check_against_torch(module, args, ["x", "labels"])


def test_residual_cnn_matches_torch():
    torch.manual_seed(1)
    module = ResCNN()
    args = (torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,)))
    _check_against_torch(module, args, ["x", "labels"])


def test_attention_layernorm_embedding_matches_torch():
    torch.manual_seed(2)
    module = Attention()
    tokens = torch.randint(0, 13, (3, 6))
    tokens[:, 0] = 4  # repeated indices: the embedding gradient is a ScatterND(add)
    args = (tokens, torch.randn(3, 6, 13))
    _check_against_torch(module, args, ["tokens", "target"])


def test_freeze_and_explicit_parameters():
    torch.manual_seed(0)
    module = MLP()
    args = (torch.randn(4, 12), torch.randint(0, 7, (4,)))
    forward = _export(module, args, ["x", "labels"])
    train = build_training_graph(forward, freeze=["l1.weight", "l1.bias"])
    outs = [o.name for o in train.graph.output]
    assert "l1.weight_grad" not in outs and "l2.weight_grad" in outs
    assert {"l1.weight", "l1.bias"} <= {t.name for t in train.graph.initializer}
    train = build_training_graph(forward, parameters=["l3.bias"])
    assert [o.name for o in train.graph.output] == ["loss", "l3.bias_grad"]
    _session(train).run(None, {"x": args[0].numpy(), "labels": args[1].numpy()})


def _tiny(nodes, inits, inputs, extra_opsets=()):
    graph = helper.make_graph(nodes, "tiny", inputs,
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              inits)
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, 1) for d in extra_opsets]
    return helper.make_model(graph, opset_imports=opsets)


def test_custom_op_is_unsupported():
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    model = _tiny([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                   helper.make_node("Mystery", ["h"], ["m"], name="odd", domain="my.ops"),
                   helper.make_node("ReduceSum", ["m"], ["loss"], name="sum", keepdims=0)],
                  [w], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                  extra_opsets=["my.ops"])
    with pytest.raises(UnsupportedOpError, match="Mystery"):
        build_training_graph(model)


def test_op_without_gradient_rule_is_unsupported():
    # neither onnx-ad 0.3 nor graphopt differentiates MaxRoiPool
    w = numpy_helper.from_array(np.ones((1, 2, 4, 4), np.float32), "w")
    rois = numpy_helper.from_array(np.array([[0, 0, 0, 3, 3]], np.float32), "rois")
    model = _tiny([helper.make_node("Mul", ["x", "w"], ["scaled"], name="scale"),
                   helper.make_node("MaxRoiPool", ["scaled", "rois"], ["y"], name="pool", pooled_shape=[2, 2]),
                   helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)],
                  [w, rois], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])])
    with pytest.raises(UnsupportedOpError, match="MaxRoiPool") as info:
        build_training_graph(model, parameters=["w"])
    assert "pool" in str(info.value)


def test_no_parameter_reaches_loss():
    w = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    model = _tiny([helper.make_node("Mul", ["x", "x"], ["sq"], name="sq"),
                   helper.make_node("Add", ["w", "w"], ["unused"], name="unused"),
                   helper.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0)],
                  [w], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])])
    with pytest.raises(InvalidModelError):
        build_training_graph(model)
    with pytest.raises(InvalidModelError):
        build_training_graph(model, loss="output:nope")
    # a parameter reaching the loss only through its shape carries no gradient either
    model2 = _tiny([helper.make_node("Shape", ["w"], ["s"], name="shape"),
                    helper.make_node("Cast", ["s"], ["sf"], name="cast", to=TensorProto.FLOAT),
                    helper.make_node("Mul", ["x", "sf"], ["p"], name="mul"),
                    helper.make_node("ReduceSum", ["p"], ["loss"], name="sum", keepdims=0)],
                   [w], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])])
    with pytest.raises(InvalidModelError):
        build_training_graph(model2)


def test_embedding_gradient_is_exact_with_threads():
    # ScatterND(add), the raw gradient of Gather, races on repeated indices with 2+ threads
    # (measured 0.45 relative error at this size): the builder emits ScatterElements instead.
    torch.manual_seed(3)
    vocab, width = 1000, 128

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

        def forward(self, tokens):
            return self.head(torch.tanh(self.embedding(tokens)))

    module = Embed()
    tokens = torch.randint(0, vocab, (64, 256))
    tokens[:, ::4] = 7
    labels = torch.randint(0, vocab, (64, 256))
    buffer = io.BytesIO()
    torch.onnx.export(module, (tokens,), buffer, input_names=["tokens"], output_names=["logits"],
                      dynamo=False, opset_version=17, do_constant_folding=False)
    train = build_training_graph(onnx.load_from_string(buffer.getvalue()), loss="cross_entropy")
    assert "ScatterND" not in {n.op_type for n in train.graph.node}
    F.cross_entropy(module(tokens).reshape(-1, vocab), labels.reshape(-1)).backward()
    expected = module.embedding.weight.grad.numpy()
    names = [o.name for o in train.graph.output]
    for threads in (1, 2, 4):
        got = dict(zip(names, open_session(train, threads=threads).run(
            None, {"tokens": tokens.numpy(), "labels": labels.numpy()})))["embedding.weight_grad"]
        assert np.abs(got - expected).max() / np.abs(expected).max() <= 1e-5, threads
