'use strict';
// Which external-data files an ONNX model references, read with a PARTIAL ONNX schema.
//
// Protobuf decoders skip fields a schema does not declare, so declaring only the path from
// ModelProto to the TensorProto external_data entries is enough to find every location
// without a full onnx.proto. Field numbers are those of onnx/onnx.proto (onnx 1.17-1.24):
//   ModelProto      7 graph, 25 functions
//   FunctionProto   7 node
//   GraphProto      1 node, 5 initializer, 15 sparse_initializer
//   NodeProto       5 attribute
//   AttributeProto  5 t, 6 g, 10 tensors, 11 graphs, 22 sparse_tensor, 23 sparse_tensors
//   SparseTensorProto 1 values, 2 indices
//   TensorProto     8 name, 13 external_data, 14 data_location (EXTERNAL = 1)
//   StringStringEntryProto 1 key, 2 value
// The tensors scanned are those onnx.load_external_data_for_model loads (initializers,
// tensor attributes, subgraphs, functions) plus sparse tensors.

const fs = require('fs');
const path = require('path');
const protobuf = require('protobufjs');

const PARTIAL_ONNX = `
syntax = "proto2";
package graphopt_partial_onnx;

message StringStringEntryProto {
  optional string key = 1;
  optional string value = 2;
}

message TensorProto {
  enum DataLocation {
    DEFAULT = 0;
    EXTERNAL = 1;
  }
  optional string name = 8;
  repeated StringStringEntryProto external_data = 13;
  optional DataLocation data_location = 14;
}

message SparseTensorProto {
  optional TensorProto values = 1;
  optional TensorProto indices = 2;
}

message AttributeProto {
  optional string name = 1;
  optional TensorProto t = 5;
  optional GraphProto g = 6;
  repeated TensorProto tensors = 10;
  repeated GraphProto graphs = 11;
  optional SparseTensorProto sparse_tensor = 22;
  repeated SparseTensorProto sparse_tensors = 23;
}

message NodeProto {
  optional string name = 3;
  repeated AttributeProto attribute = 5;
}

message GraphProto {
  repeated NodeProto node = 1;
  repeated TensorProto initializer = 5;
  repeated SparseTensorProto sparse_initializer = 15;
}

message FunctionProto {
  repeated NodeProto node = 7;
}

message ModelProto {
  optional GraphProto graph = 7;
  repeated FunctionProto functions = 25;
}
`;

const EXTERNAL = 1;

let modelType = null;
function partialModelType() {
  if (!modelType) {
    const root = protobuf.parse(PARTIAL_ONNX, { keepCase: true }).root;
    modelType = root.lookupType('graphopt_partial_onnx.ModelProto');
  }
  return modelType;
}

/** Decode `bytes` with the partial schema; throws on bytes that are not protobuf. */
function decodePartialModel(bytes) {
  return partialModelType().decode(bytes);
}

function* sparseTensors(list) {
  for (const sparse of list || []) {
    if (sparse.values) yield sparse.values;
    if (sparse.indices) yield sparse.indices;
  }
}

function* graphTensors(graph) {
  if (!graph) return;
  yield* graph.initializer || [];
  yield* sparseTensors(graph.sparse_initializer);
  yield* nodeTensors(graph.node);
}

function* nodeTensors(nodes) {
  for (const node of nodes || []) {
    for (const attr of node.attribute || []) {
      if (attr.t) yield attr.t;
      yield* attr.tensors || [];
      if (attr.sparse_tensor) yield* sparseTensors([attr.sparse_tensor]);
      yield* sparseTensors(attr.sparse_tensors);
      if (attr.g) yield* graphTensors(attr.g);
      for (const sub of attr.graphs || []) yield* graphTensors(sub);
    }
  }
}

/** Every TensorProto of a decoded (partial) model, with the external ones among them. */
function* modelTensors(model) {
  yield* graphTensors(model.graph);
  for (const fn of model.functions || []) yield* nodeTensors(fn.node);
}

/** [{tensor, location}] for each tensor whose data_location is EXTERNAL (location may be ''). */
function externalReferences(model) {
  const refs = [];
  for (const tensor of modelTensors(model)) {
    if (tensor.data_location !== EXTERNAL) continue;
    let location = '';
    for (const entry of tensor.external_data || []) {
      if (entry.key === 'location') location = entry.value || '';
    }
    refs.push({ tensor: tensor.name || '', location });
  }
  return refs;
}

class ExternalDataError extends Error {
  constructor(message) {
    super(message);
    this.name = 'ExternalDataError';
  }
}

/**
 * Check one location (as written in the model) against the model's folder; returns the
 * absolute local path. Refuses empty, absolute and escaping locations.
 */
function resolveLocation(modelDir, location, tensorName) {
  const what = `tensor ${JSON.stringify(tensorName)}`;
  if (!location) {
    throw new ExternalDataError(`${what}: external data without a location`);
  }
  if (location.includes('\0')) {
    throw new ExternalDataError(`${what}: external data location ${JSON.stringify(location)} holds a NUL byte`);
  }
  if (path.isAbsolute(location) || path.win32.isAbsolute(location)) {
    throw new ExternalDataError(
      `${what}: external data location ${JSON.stringify(location)} is absolute; ` +
      "it must be relative to the model's folder");
  }
  const base = path.resolve(modelDir);
  const target = path.resolve(base, location);
  const rel = path.relative(base, target);
  if (!rel || rel === '..' || rel.startsWith('..' + path.sep) || path.isAbsolute(rel)) {
    throw new ExternalDataError(
      `${what}: external data location ${JSON.stringify(location)} points outside the model's ` +
      `folder ${JSON.stringify(base)}`);
  }
  return target;
}

/**
 * The external-data files of the model at `modelPath`: [{path, localPath}] with `path` the
 * location as written in the model (first spelling of each distinct file) and `localPath`
 * the file on this machine; each distinct file once, in order of first reference.
 *
 * Bytes that do not decode as protobuf give [] (the server judges what is not a model).
 */
function externalDataFiles(modelPath, bytes) {
  if (bytes === undefined) bytes = fs.readFileSync(modelPath);
  let model;
  try {
    model = decodePartialModel(bytes);
  } catch (err) {
    return [];
  }
  const modelDir = path.dirname(path.resolve(modelPath));
  const modelAbs = path.resolve(modelPath);
  const seen = new Map();
  for (const { tensor, location } of externalReferences(model)) {
    const localPath = resolveLocation(modelDir, location, tensor);
    if (localPath === modelAbs) {
      throw new ExternalDataError(
        `tensor ${JSON.stringify(tensor)}: external data location ${JSON.stringify(location)} is the model file itself`);
    }
    if (seen.has(localPath)) continue;
    let stat;
    try {
      stat = fs.statSync(localPath);
    } catch (err) {
      throw new ExternalDataError(
        `tensor ${JSON.stringify(tensor)}: external data file ${JSON.stringify(location)} does not exist ` +
        `(looked for ${localPath})`);
    }
    if (!stat.isFile()) {
      throw new ExternalDataError(
        `tensor ${JSON.stringify(tensor)}: external data location ${JSON.stringify(location)} is not a file`);
    }
    seen.set(localPath, { path: location, localPath });
  }
  return [...seen.values()];
}

module.exports = {
  PARTIAL_ONNX,
  ExternalDataError,
  decodePartialModel,
  externalReferences,
  externalDataFiles,
  resolveLocation,
};
