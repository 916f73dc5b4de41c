"""The optimizer step inside the training graph: SGD and AdamW as `torch.optim` defines them.

`fuse_optimizer` turns a finished training graph (outputs ``loss``, ``<param>_grad`` per
parameter, extras) into one that takes the current parameters and optimizer state as inputs
and returns them updated:

* inputs: every trainable parameter under its own name (its initializer stays as the
  default value), the optimizer state (below), and every running statistic ``<s>`` whose
  update ``<s>_updated`` is an output (BatchNormalization), besides the data inputs;
* outputs: ``loss``, then ``<param>_updated`` per parameter, then ``<state>_updated`` per
  state input, then the other extras (``<stat>_updated``, Dropout masks). Every
  ``<name>_updated`` output is the next step's value of input ``<name>``.

Optimizer state (float tensors shaped like their parameter unless said; defaults in the file):

    sgd, momentum > 0   <param>.momentum_buffer   zeros
    adamw               <param>.exp_avg           zeros
                        <param>.exp_avg_sq        zeros
                        optimizer.step            float32 scalar, 0 (the steps taken so far)

A zero momentum buffer gives exactly torch's first step (``momentum * 0 + g == g``), so no
"first step" flag is needed. Each parameter's update is placed right after its gradient is
complete, so the gradient is read once and dies there instead of living to the end of the
step as a graph output. The arithmetic follows torch's single-tensor CPU code op by op
(torch/optim/sgd.py, adam.py with decoupled weight decay): AdamW's bias corrections are
computed in float64, as torch computes them from a Python float step count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.runtime.step_state import UPDATED_SUFFIX
from graphopt.errors import InvalidModelError, InvalidOptionError

from graphopt.runtime.weights import DETACH_MIN_BYTES, zeros_stub

from .graph_util import Names

OPTIMIZERS = ("sgd", "adamw")
STEP_NAME = "optimizer.step"
UPDATED = UPDATED_SUFFIX
GRAD = "_grad"


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer and its hyper-parameters; `weight_decay=None` takes torch's default for the
    kind (0 for SGD, 0.01 for AdamW)."""
    kind: str
    lr: float
    momentum: float = 0.0
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @property
    def decay(self) -> float:
        if self.weight_decay is not None:
            return float(self.weight_decay)
        return 0.01 if self.kind == "adamw" else 0.0

    def check(self) -> None:
        """Raise InvalidOptionError naming the first bad value."""
        if self.kind not in OPTIMIZERS:
            raise InvalidOptionError(f"unknown optimizer {self.kind!r}: use one of {', '.join(OPTIMIZERS)}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise InvalidOptionError(f"learning rate must be a positive number, got {self.lr}")
        if not (np.isfinite(self.decay) and self.decay >= 0):
            raise InvalidOptionError(f"weight decay must be >= 0, got {self.decay}")
        if self.kind == "sgd":
            if not (np.isfinite(self.momentum) and 0 <= self.momentum < 1):
                raise InvalidOptionError(f"momentum must be in [0, 1), got {self.momentum}")
        else:
            if self.momentum:
                raise InvalidOptionError("adamw takes no momentum (its betas are the moments' decay rates)")
            if len(self.betas) != 2 or not all(np.isfinite(b) and 0 <= b < 1 for b in self.betas):
                raise InvalidOptionError(f"betas must be two numbers in [0, 1), got {self.betas}")
            if not (np.isfinite(self.eps) and self.eps > 0):
                raise InvalidOptionError(f"eps must be a positive number, got {self.eps}")

    def state_names(self, param: str) -> list[str]:
        """The per-parameter state inputs, in output order."""
        if self.kind == "adamw":
            return [f"{param}.exp_avg", f"{param}.exp_avg_sq"]
        return [f"{param}.momentum_buffer"] if self.momentum else []

    def to_metadata(self) -> str:
        parts = [f"kind={self.kind}", f"lr={self.lr!r}", f"weight_decay={self.decay!r}"]
        if self.kind == "sgd":
            parts.append(f"momentum={self.momentum!r}")
        else:
            parts += [f"betas={self.betas[0]!r},{self.betas[1]!r}", f"eps={self.eps!r}"]
        return ";".join(parts)


METADATA_KEY = "graphopt.optimizer"


# a parameter's AdamW moments made in blocks of rows (`fuse_optimizer`'s chunks) are made in
# blocks of about this many bytes
CHUNK_BYTES = 2 << 20


@dataclass(frozen=True)
class FusedUpdates:
    """Where `fuse_optimizer` wrote its nodes: `head` (the step count and bias corrections,
    first in the file), by the name of the node that completes a gradient the update nodes
    written right after it, in their order, and by parameter the nodes of its update."""
    head: list[str]
    after: dict[str, list[str]]
    by_param: dict[str, list[str]]


def chunk_rows(rows: int, pieces: int) -> list:
    """[(start, end)] of `pieces` blocks of `rows` rows, as even as can be (at most `rows`
    blocks; [None]: one piece, the whole tensor)."""
    pieces = max(1, min(int(pieces), rows))
    if pieces == 1:
        return [None]
    edges = [rows * k // pieces for k in range(pieces + 1)]
    return list(zip(edges[:-1], edges[1:]))


def fuse_optimizer(model: onnx.ModelProto, params: list[str], spec: OptimizerSpec,
                   chunks: dict[str, int] | None = None) -> FusedUpdates:
    """In place, on a finished training graph whose outputs are ``loss``, ``<p>_grad`` for each of
    `params` (in that order) and extras: the update of each parameter in the graph (see the
    module docstring), each right after the node that completes its gradient, in the order
    it should run. `chunks`: parameter -> the number of blocks of rows its AdamW moments are
    made in (see `update`; others in one). Raises InvalidModelError when a name it needs is
    taken."""
    spec.check()
    chunks = dict(chunks or {})
    graph = model.graph
    outputs = list(graph.output)
    grads = [p + GRAD for p in params]
    if [o.name for o in outputs[1:1 + len(params)]] != grads:
        raise InvalidModelError("fuse_optimizer needs the outputs loss, then <param>_grad per parameter")
    initializers = {t.name: t for t in graph.initializer}
    input_names = {v.name for v in graph.input}
    produced = {o for n in graph.node for o in n.output if o}
    taken = set(initializers) | input_names | produced
    names = Names(model)
    states = {p: spec.state_names(p) for p in params}
    wanted = [n for p in params for n in [p + UPDATED] + states[p]]
    wanted += [n + UPDATED for p in params for n in states[p]]
    if spec.kind == "adamw":
        wanted += [STEP_NAME, STEP_NAME + UPDATED]
    clash = [n for n in wanted if n in taken]
    if clash:
        raise InvalidModelError(f"the training graph already has tensors named {clash[:5]}: the optimizer's "
                                f"inputs and outputs need those names")
    names.taken.update(wanted)

    new_inputs, new_initializers, state_outputs = [], [], []
    for p in params:
        t = initializers[p]
        dims, elem_type = list(t.dims), t.data_type
        if elem_type != TensorProto.FLOAT and spec.kind == "adamw":
            raise InvalidModelError(f"parameter {p!r} is not float32: the fused AdamW step supports float32 only")
        if p not in input_names:
            new_inputs.append(helper.make_tensor_value_info(p, elem_type, dims))
        for s in states[p]:
            np_dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            if int(np.prod(dims, dtype=np.int64)) * np_dtype.itemsize >= DETACH_MIN_BYTES:
                new_initializers.append(zeros_stub(s, elem_type, dims))   # made when written (weights.py)
            else:
                new_initializers.append(numpy_helper.from_array(np.zeros(dims, np_dtype), s))
            new_inputs.append(helper.make_tensor_value_info(s, elem_type, dims))
            state_outputs.append(helper.make_tensor_value_info(s + UPDATED, elem_type, dims))
    # running statistics updated by the graph (BatchNormalization): inputs too, so that a trainer
    # can feed each step's update back
    for o in outputs[1 + len(params):]:
        base = o.name[:-len(UPDATED)] if o.name.endswith(UPDATED) else None
        if base and base in initializers and base not in input_names:
            t = initializers[base]
            new_inputs.append(helper.make_tensor_value_info(base, t.data_type, list(t.dims)))

    def const(value, elem_type=TensorProto.FLOAT, stem="optimizer/const") -> str:
        name = names.fresh(stem)
        new_initializers.append(numpy_helper.from_array(
            np.array(value, dtype=helper.tensor_dtype_to_np_dtype(elem_type)), name))
        return name

    row_constants: dict[int, str] = {}

    def row_constant(value: int) -> str:
        if value not in row_constants:
            row_constants[value] = const([value], TensorProto.INT64, "optimizer/rows")
        return row_constants[value]

    def node(op, inputs, stem, **attrs) -> tuple[str, onnx.NodeProto]:
        out = names.fresh(stem)
        return out, helper.make_node(op, inputs, [out], name=names.fresh(stem + "/" + op), **attrs)

    head: list = []          # scalar work shared by every update (AdamW's bias corrections)
    if spec.kind == "adamw":
        b1, b2 = spec.betas
        new_initializers.append(numpy_helper.from_array(np.array(0.0, np.float32), STEP_NAME))
        new_inputs.append(helper.make_tensor_value_info(STEP_NAME, TensorProto.FLOAT, []))
        state_outputs.append(helper.make_tensor_value_info(STEP_NAME + UPDATED, TensorProto.FLOAT, []))
        head.append(helper.make_node("Add", [STEP_NAME, const(1.0)], [STEP_NAME + UPDATED],
                                     name=names.fresh("optimizer/step/Add")))
        step64, n = node("Cast", [STEP_NAME + UPDATED], "optimizer/step64", to=TensorProto.DOUBLE)
        head.append(n)
        one64 = const(1.0, TensorProto.DOUBLE)
        powered1, n = node("Pow", [const(b1, TensorProto.DOUBLE), step64], "optimizer/beta1_power")
        head.append(n)
        correction1, n = node("Sub", [one64, powered1], "optimizer/bias_correction1")
        head.append(n)
        size64, n = node("Div", [const(spec.lr, TensorProto.DOUBLE), correction1], "optimizer/step_size")
        head.append(n)
        negative64, n = node("Neg", [size64], "optimizer/minus_step_size")
        head.append(n)
        minus_step_size, n = node("Cast", [negative64], "optimizer/minus_step_size32", to=TensorProto.FLOAT)
        head.append(n)
        powered2, n = node("Pow", [const(b2, TensorProto.DOUBLE), step64], "optimizer/beta2_power")
        head.append(n)
        correction2, n = node("Sub", [one64, powered2], "optimizer/bias_correction2")
        head.append(n)
        root64, n = node("Sqrt", [correction2], "optimizer/bias_correction2_sqrt")
        head.append(n)
        correction2_sqrt, n = node("Cast", [root64], "optimizer/bias_correction2_sqrt32", to=TensorProto.FLOAT)
        head.append(n)
        decay = const(np.float32(1.0 - spec.lr * spec.decay)) if spec.decay else None
        one_minus_b1, b2_const = const(np.float32(1.0 - b1)), const(np.float32(b2))
        one_minus_b2, eps = const(np.float32(1.0 - b2)), const(np.float32(spec.eps))
    else:
        # in each parameter's own type (a float64 parameter steps in float64, as torch's does)
        sgd_constants: dict[int, tuple] = {}

        def constants_for(elem_type: int) -> tuple:
            if elem_type not in sgd_constants:
                sgd_constants[elem_type] = (const(-spec.lr, elem_type),
                                            const(spec.decay, elem_type) if spec.decay else None,
                                            const(spec.momentum, elem_type) if spec.momentum else None)
            return sgd_constants[elem_type]

    def update(p: str) -> list:
        g, nodes = p + GRAD, []

        def emit(op, inputs, stem, out=None, **attrs):
            if out is None:
                out, n = node(op, inputs, f"{p}/{stem}", **attrs)
            else:
                n = helper.make_node(op, inputs, [out], name=names.fresh(f"{p}/{stem}/{op}"), **attrs)
            nodes.append(n)
            return out

        if spec.kind == "sgd":
            minus_lr, weight_decay, momentum = constants_for(initializers[p].data_type)
            d = g
            if weight_decay:                            # grad.add(param, alpha=wd)
                d = emit("Add", [g, emit("Mul", [p, weight_decay], "decayed")], "decayed_grad")
            if momentum:                                # buf.mul_(momentum).add_(grad)
                kept_momentum = emit("Mul", [states[p][0], momentum], "momentum")
                d = emit("Add", [kept_momentum, d], "buffer", out=states[p][0] + UPDATED)
            emit("Add", [p, emit("Mul", [d, minus_lr], "step")], "update", out=p + UPDATED)
        else:
            m, v = states[p]
            # In the order it runs (the graph runs in file order: PRIORITY_BASED), each node as
            # late as its inputs allow, so that at most the gradient and two parameter-sized
            # temporaries are alive at once: the first moment, then the second (the gradient's
            # last reader), the denominator, the step, and the parameter's decay last.
            # A parameter in `chunks` has its moments made piece by piece, each a block of rows
            # joined (Concat) into the buffer the caller binds: the gradient, one parameter's
            # size of pieces and a few pieces' temporaries are alive at once, not the gradient
            # and two parameter-sized temporaries. The arithmetic is the same element by element.
            pieces = chunk_rows(int(initializers[p].dims[0]), chunks.get(p, 1)) \
                if initializers[p].dims else [None]

            def piece(x, rows, stem):
                if rows is None:
                    return x
                return emit("Slice", [x, row_constant(rows[0]), row_constant(rows[1]), row_constant(0)],
                            f"{stem}_rows{rows[0]}")

            def joined(parts, stem, out):
                return parts[0] if len(parts) == 1 else emit("Concat", parts, stem, out=out, axis=0)

            # exp_avg.lerp_(grad, 1 - beta1) = m + (1 - beta1) * (g - m)
            m_out = m + UPDATED if pieces == [None] else None
            m_parts = []
            for rows in pieces:
                g_k, m_k = piece(g, rows, "grad"), piece(m, rows, "exp_avg_rows")
                m_parts.append(emit("Add", [m_k, emit("Mul", [emit("Sub", [g_k, m_k], "grad_minus_avg"),
                                                             one_minus_b1], "lerp")], "exp_avg", out=m_out))
            m_new = joined(m_parts, "exp_avg", m + UPDATED)
            # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            v_out = v + UPDATED if pieces == [None] else None
            v_parts = []
            for rows in pieces:
                g_k, v_k = piece(g, rows, "grad"), piece(v, rows, "exp_avg_sq_rows")
                scaled = emit("Mul", [emit("Mul", [g_k, one_minus_b2], "grad_scaled"), g_k], "grad_sq")
                v_parts.append(emit("Add", [emit("Mul", [v_k, b2_const], "avg_sq_decayed"), scaled], "exp_avg_sq",
                                    out=v_out))
            v_new = joined(v_parts, "exp_avg_sq", v + UPDATED)
            # denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
            denom = emit("Add", [emit("Div", [emit("Sqrt", [v_new], "root"), correction2_sqrt], "root_corrected"),
                                 eps], "denom")
            # param.mul_(1 - lr * wd); param.addcdiv_(exp_avg, denom, value=-step_size)
            step = emit("Mul", [emit("Div", [m_new, denom], "ratio"), minus_step_size], "step")
            start = emit("Mul", [p, decay], "decayed") if decay else p
            emit("Add", [start, step], "update", out=p + UPDATED)
        return nodes

    # each update right after the node that completes its gradient
    producer_index = {o: k for k, n in enumerate(graph.node) for o in n.output if o}
    after: dict[int, list] = {}
    by_param: dict[str, list[str]] = {}
    for p, g in zip(params, grads):
        if g not in producer_index:
            raise InvalidModelError(f"the gradient {g!r} is not computed by any node")
        written_for_p = update(p)
        by_param[p] = [n.name for n in written_for_p]
        after.setdefault(producer_index[g], []).extend(written_for_p)
    nodes = list(head)
    for k, n in enumerate(graph.node):
        nodes.append(n)
        nodes.extend(after.get(k, ()))
    written = FusedUpdates(head=[n.name for n in head],
                           after={graph.node[k].name: [n.name for n in chain] for k, chain in after.items()},
                           by_param=by_param)
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.initializer.extend(new_initializers)
    graph.input.extend(new_inputs)
    param_outputs = [helper.make_tensor_value_info(p + UPDATED, initializers[p].data_type,
                                                   list(initializers[p].dims)) for p in params]
    graph.ClearField("output")
    graph.output.extend([outputs[0]] + param_outputs + state_outputs + outputs[1 + len(params):])
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        METADATA_KEY: spec.to_metadata()})
    return written
