"""The library's `OptimizeOptions` <-> the proto's graphopt.v1.OptimizeOptions, field by field,
driven by the options' schema (`graphopt.options.option_specs`): a new option needs nothing here.

On the wire an option is set only where it differs from the library's default; a server fills
in its own library's defaults for what is unset.
"""
from __future__ import annotations

from graphopt.options import OptimizeOptions, OptionSpec, option_specs

from ._proto import graphopt_pb2 as pb
from .transfer import ProtocolError

INPUT_DIMS = "dict[str, list[int]]"   # the one option kind that travels as messages (InputDims)


def proto_specs(cls=OptimizeOptions) -> list[OptionSpec]:
    """The options that travel: those with a proto field number."""
    return [spec for spec in option_specs(cls) if spec.proto is not None]


def to_message(options: OptimizeOptions, message: pb.OptimizeOptions | None = None) -> pb.OptimizeOptions:
    """`options` as the proto's message (into `message` when given): each option that differs
    from its default. The inputs' arrays and the progress callback have no proto field."""
    message = pb.OptimizeOptions() if message is None else message
    for spec in proto_specs(type(options)):
        value = getattr(options, spec.name)
        if value is None or value == spec.default:
            continue
        if spec.kind == INPUT_DIMS:
            for name, dims in value.items():
                getattr(message, spec.name).add(name=name, dims=[int(d) for d in dims])
        elif spec.proto_type.startswith("repeated "):
            getattr(message, spec.name).extend(value)
        else:
            setattr(message, spec.name, value)
    return message


def from_message(message: pb.OptimizeOptions, cls=OptimizeOptions) -> dict:
    """The options a message sets, in `OptimizeOptions.to_dict()`'s form: an `optional` field
    when present, a plain one when not its zero value, a repeated one when not empty (what is
    left out takes the library's default). An input_dims entry without a name or with a negative
    dimension is a ProtocolError."""
    values = {}
    for spec in proto_specs(cls):
        if spec.kind == INPUT_DIMS:
            dims = {}
            for entry in getattr(message, spec.name):
                if not entry.name:
                    raise ProtocolError(f"{spec.name} has an entry without a name")
                if any(d < 0 for d in entry.dims):
                    raise ProtocolError(f"{spec.name}[{entry.name!r}] has a negative dimension: {list(entry.dims)}")
                dims[entry.name] = list(entry.dims)
            if dims:
                values[spec.name] = dims
        elif spec.proto_type.startswith("repeated "):
            if len(getattr(message, spec.name)):
                values[spec.name] = list(getattr(message, spec.name))
        elif spec.proto_presence:
            if message.HasField(spec.name):
                values[spec.name] = getattr(message, spec.name)
        elif getattr(message, spec.name):
            values[spec.name] = getattr(message, spec.name)
    return values
