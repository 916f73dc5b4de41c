'use strict';
// GraphoptClient: the Node.js client of the graphopt gRPC service (graphopt.v1.Graphopt).
// The wire contract and its stream protocol: proto/graphopt/v1/graphopt.proto.

const crypto = require('crypto');
const fs = require('fs');
const fsp = fs.promises;
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { externalDataFiles, ExternalDataError } = require('./onnx_refs');

const MiB = 1 << 20;
const DEFAULT_CHUNK_BYTES = MiB;
const DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB;
// Room for the message framing around a chunk's data (offset, tags, lengths).
const CHUNK_OVERHEAD = 1024;

const DEFAULT_PROTO_PATH = path.join(__dirname, '../../../proto/graphopt/v1/graphopt.proto');
const HEALTH_PROTO_PATH = path.join(__dirname, '../proto/grpc/health/v1/health.proto');

// int64 fields arrive as decimal strings (lossless, as in protobuf's JSON mapping);
// enums as their names.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

/** A call that ended with a gRPC status other than OK. */
class GraphoptError extends Error {
  constructor(code, details, metadata) {
    const codeName = STATUS_NAMES[code] || `STATUS_${code}`;
    super(`${codeName}: ${details}`);
    this.name = 'GraphoptError';
    this.code = code;
    this.codeName = codeName;
    this.details = details;
    this.metadata = metadata;
  }
}

/** Something wrong on this side: a local file, a refused path, a corrupt download. */
class ClientError extends Error {
  constructor(message) {
    super(message);
    this.name = 'ClientError';
  }
}

function toError(err) {
  if (err instanceof GraphoptError || err instanceof ClientError) return err;
  if (err instanceof ExternalDataError) return new ClientError(err.message);
  if (err && typeof err.code === 'number' && 'details' in err) {
    return new GraphoptError(err.code, err.details, err.metadata);
  }
  return err;
}

function loadPackage(protoPath) {
  const definition = protoLoader.loadSync(protoPath, LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition);
}

async function sha256File(file) {
  const hash = crypto.createHash('sha256');
  let size = 0;
  for await (const chunk of fs.createReadStream(file)) {
    hash.update(chunk);
    size += chunk.length;
  }
  return { size, sha256: hash.digest('hex') };
}

// --- options -------------------------------------------------------------------------

// graphopt's OptimizeOptions (graphopt/options.py) and the service's own responseChunkBytes and
// plan: every field of the proto's graphopt.v1.OptimizeOptions message, read from its descriptor,
// under its camelCase name. No list of options here: a field added to the proto is an option.

const INT64_TYPES = new Set(['TYPE_INT64', 'TYPE_UINT64', 'TYPE_SINT64', 'TYPE_FIXED64', 'TYPE_SFIXED64']);
const INT32_TYPES = new Set(['TYPE_INT32', 'TYPE_UINT32', 'TYPE_SINT32', 'TYPE_FIXED32', 'TYPE_SFIXED32']);
const NUMBER_TYPES = new Set(['TYPE_DOUBLE', 'TYPE_FLOAT']);

/** snake_case (the proto's names) -> camelCase (this client's option keys). */
function camelCase(name) {
  return name.replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase());
}

const fieldCache = new Map();

/**
 * The fields of graphopt.v1.OptimizeOptions in the proto at `protoPath`, from its descriptor:
 * [{name (snake_case), key (camelCase), type ('TYPE_INT64', ...), repeated, typeName}].
 */
function optionFields(protoPath = DEFAULT_PROTO_PATH) {
  if (!fieldCache.has(protoPath)) {
    const definition = protoLoader.loadSync(protoPath, LOADER_OPTIONS);
    const message = definition['graphopt.v1.OptimizeOptions'];
    if (!message || !message.type || !Array.isArray(message.type.field)) {
      throw new ClientError(`${protoPath} has no message graphopt.v1.OptimizeOptions`);
    }
    fieldCache.set(protoPath, message.type.field.map((f) => ({
      name: f.name, key: camelCase(f.name), type: f.type, repeated: f.label === 'LABEL_REPEATED',
      typeName: String(f.typeName || '').replace(/^\./, ''),
    })));
  }
  return fieldCache.get(protoPath);
}

function integerString(value, what) {
  if (typeof value === 'bigint' && value >= 0n) return value.toString();
  if (typeof value === 'string' && /^[0-9]+$/.test(value)) return value;
  if (typeof value === 'number' && Number.isSafeInteger(value) && value >= 0) return String(value);
  throw new ClientError(`${what} must be a non-negative integer, not ${JSON.stringify(String(value))}`);
}

/** One value of a scalar field, checked by its proto type (every number option is >= 0). */
function scalarValue(field, value, what) {
  if (INT64_TYPES.has(field.type)) return integerString(value, what);
  if (INT32_TYPES.has(field.type)) {
    const text = integerString(value, what);
    if (Number(text) > 2 ** 31 - 1) throw new ClientError(`${what} must be at most ${2 ** 31 - 1}, not ${text}`);
    return Number(text);
  }
  if (NUMBER_TYPES.has(field.type)) {
    const number = typeof value === 'string' && value.trim() !== '' ? Number(value) : value;
    if (typeof number !== 'number' || !Number.isFinite(number) || number < 0) {
      throw new ClientError(`${what} must be a finite number >= 0, not ${JSON.stringify(String(value))}`);
    }
    return number;
  }
  if (field.type === 'TYPE_BOOL') {
    if (typeof value !== 'boolean') throw new ClientError(`${what} must be true or false, not ${JSON.stringify(value)}`);
    return value;
  }
  if (field.type === 'TYPE_STRING') {
    if (typeof value === 'object') throw new ClientError(`${what} must be a string, not ${JSON.stringify(value)}`);
    return String(value);
  }
  throw new ClientError(`option ${what}: this client cannot send a ${field.type} field`);
}

/** inputDims: {name: [d, ...]} or [{name, dims}] -> [InputDims]. */
function inputDimsValue(value, what) {
  if (!value || typeof value !== 'object') throw new ClientError(`${what} must be {name: [d, ...]} or [{name, dims}]`);
  const entries = Array.isArray(value) ? value.map((e) => [e && e.name, e && e.dims]) : Object.entries(value);
  return entries.map(([name, dims]) => {
    if (dims !== undefined && dims !== null && !Array.isArray(dims)) {
      throw new ClientError(`${what}: the dimensions of input ${name} must be a list`);
    }
    return { name: String(name), dims: (dims || []).map((d) => integerString(d, `dimension of input ${name}`)) };
  });
}

function fieldValue(field, value) {
  if (field.type === 'TYPE_MESSAGE') {
    if (field.typeName.endsWith('InputDims') && field.repeated) return inputDimsValue(value, field.key);
    throw new ClientError(`option ${field.key}: this client cannot send a ${field.typeName} message`);
  }
  if (field.repeated) {
    if (!Array.isArray(value)) throw new ClientError(`${field.key} must be a list, not ${JSON.stringify(value)}`);
    return value.map((v, i) => scalarValue(field, v, `${field.key}[${i}]`));
  }
  return scalarValue(field, value, field.key);
}

/**
 * JS options -> graphopt.v1.OptimizeOptions: each key the camelCase name of one of the message's
 * fields (budgetBytes, maxOverhead, inputDims, ...; see graphopt/options.py or the proto for what
 * each means), its value checked by the field's type: int64 as a non-negative integer (sent as a
 * decimal string), numbers finite and >= 0, booleans, strings, lists for repeated fields, and
 * inputDims as {name: [d, ...]} or [{name, dims}]. An option left out (or null) is not sent: the
 * server's library defaults apply. `fields`: optionFields() of the proto in use.
 */
function toProtoOptions(options = {}, fields = optionFields()) {
  const byKey = new Map(fields.map((f) => [f.key, f]));
  const out = {};
  for (const [key, value] of Object.entries(options)) {
    const field = byKey.get(key);
    if (!field) {
      throw new ClientError(`unknown option ${JSON.stringify(key)} (known: ${[...byKey.keys()].join(', ')})`);
    }
    if (value === undefined || value === null) continue;
    out[field.name] = fieldValue(field, value);
  }
  return out;
}

/**
 * Drop the virtual fields proto-loader adds for proto3 `optional` fields (`oneofs: true`
 * names each synthetic oneof `_<field>`), so that objects print like the messages.
 */
function withoutSyntheticOneofs(message) {
  if (!message || typeof message !== 'object' || Buffer.isBuffer(message)) return message;
  if (Array.isArray(message)) return message.map(withoutSyntheticOneofs);
  for (const key of Object.keys(message)) {
    if (key.startsWith('_') && message[key] === key.slice(1)) delete message[key];
    else message[key] = withoutSyntheticOneofs(message[key]);
  }
  return message;
}

function parseJsonField(message) {
  withoutSyntheticOneofs(message);
  if (message && typeof message.json === 'string' && message.json !== '') {
    try {
      message.full = JSON.parse(message.json);
    } catch (err) {
      throw new ClientError(`the server's JSON is not valid JSON: ${err.message}`);
    }
  } else if (message) {
    message.full = null;
  }
  return message;
}

// --- streams -------------------------------------------------------------------------

/** Resolves when `call` can take more writes, or when it has ended (then `ended` is set). */
function writable(call, state) {
  return new Promise((resolve) => {
    if (state.ended) return resolve();
    const done = () => {
      call.removeListener('drain', done);
      state.waiters.delete(done);
      resolve();
    };
    call.once('drain', done);
    state.waiters.add(done);
  });
}

function trackEnd(call) {
  const state = { ended: false, waiters: new Set() };
  const end = () => {
    state.ended = true;
    for (const waiter of [...state.waiters]) waiter();
  };
  call.on('status', end);
  call.on('error', end);
  call.on('close', end);
  return state;
}

async function send(call, state, message) {
  if (state.ended) return false;
  if (!call.write(message)) await writable(call, state);
  return !state.ended;
}

/**
 * Write the upload (options, then each file's header and chunks) to `call`, then half-close.
 * Returns early, without error, when the call has ended (the server's status tells why).
 */
async function upload(call, state, files, protoOptions, chunkBytes) {
  if (!(await send(call, state, { options: protoOptions }))) return;
  for (const file of files) {
    const header = { path: file.path, size_bytes: String(file.size), sha256: file.sha256 };
    if (!(await send(call, state, { file: header }))) return;
    const handle = await fsp.open(file.localPath, 'r');
    const hash = crypto.createHash('sha256');
    let offset = 0;
    try {
      while (offset < file.size) {
        const length = Math.min(chunkBytes, file.size - offset);
        const data = Buffer.allocUnsafe(length);
        const { bytesRead } = await handle.read(data, 0, length, offset);
        if (bytesRead !== length) {
          throw new ClientError(`${file.localPath} changed while it was uploaded (shorter than ${file.size} bytes)`);
        }
        hash.update(data);
        if (!(await send(call, state, { chunk: { offset: String(offset), data } }))) return;
        offset += length;
      }
    } finally {
      await handle.close();
    }
    if (hash.digest('hex') !== file.sha256) {
      throw new ClientError(`${file.localPath} changed while it was uploaded (its SHA-256 differs)`);
    }
  }
  if (!state.ended) call.end();
}

// --- downloads -----------------------------------------------------------------------

/**
 * Writes the files of an Optimize response: the first to `outputPath`, every further one
 * relative to the output's folder. Each goes to a temporary name in its final folder and is
 * renamed only when the whole response arrived and checked out.
 */
class Download {
  constructor(outputPath) {
    this.outputPath = path.resolve(outputPath);
    this.outputDir = path.dirname(this.outputPath);
    this.files = [];           // {target, temp, size, sha256, written, hash, handle}
    this.current = null;
    this.createdDirs = [];
    this.tag = `.graphopt-${process.pid}-${crypto.randomBytes(4).toString('hex')}.part`;
  }

  targetFor(relPath) {
    if (this.files.length === 0) return this.outputPath;
    if (!relPath || relPath.includes('\0') || path.isAbsolute(relPath) || path.win32.isAbsolute(relPath)) {
      throw new ClientError(`the server sent a file with an invalid path ${JSON.stringify(relPath)}`);
    }
    const target = path.resolve(this.outputDir, relPath);
    const rel = path.relative(this.outputDir, target);
    if (!rel || rel === '..' || rel.startsWith('..' + path.sep) || path.isAbsolute(rel)) {
      throw new ClientError(
        `the server sent a file whose path ${JSON.stringify(relPath)} points outside the output folder`);
    }
    if (target === this.outputPath || this.files.some((f) => f.target === target)) {
      throw new ClientError(`the server sent the file ${JSON.stringify(relPath)} twice`);
    }
    return target;
  }

  async mkdirs(dir) {
    const missing = [];
    for (let d = dir; ; d = path.dirname(d)) {
      try {
        await fsp.stat(d);
        break;
      } catch {
        missing.push(d);
        if (path.dirname(d) === d) break;
      }
    }
    await fsp.mkdir(dir, { recursive: true });
    this.createdDirs.push(...missing);
  }

  async header(header) {
    await this.finishCurrent();
    const size = Number(header.size_bytes);
    if (!Number.isSafeInteger(size) || size < 0) {
      throw new ClientError(`the server announced ${JSON.stringify(header.path)} with size ${header.size_bytes}`);
    }
    if (!/^[0-9a-f]{64}$/.test(header.sha256)) {
      throw new ClientError(
        `the server announced ${JSON.stringify(header.path)} with an invalid sha256 ${JSON.stringify(header.sha256)}`);
    }
    const target = this.targetFor(header.path);
    await this.mkdirs(path.dirname(target));
    const temp = path.join(path.dirname(target), '.' + path.basename(target) + this.tag);
    const file = { path: header.path, target, temp, size, sha256: header.sha256, written: 0,
      hash: crypto.createHash('sha256'), handle: null };
    this.files.push(file);
    file.handle = await fsp.open(temp, 'wx');
    this.current = file;
  }

  async chunk(chunk) {
    const file = this.current;
    if (!file) throw new ClientError('the server sent a file chunk before any file header');
    const offset = Number(chunk.offset);
    const data = chunk.data || Buffer.alloc(0);
    if (offset !== file.written) {
      throw new ClientError(
        `the server sent ${JSON.stringify(file.path)} out of order: chunk at offset ${chunk.offset}, ` +
        `expected ${file.written}`);
    }
    if (file.written + data.length > file.size) {
      throw new ClientError(
        `the server sent more than the announced ${file.size} bytes of ${JSON.stringify(file.path)}`);
    }
    let done = 0;
    while (done < data.length) {
      const { bytesWritten } = await file.handle.write(data, done, data.length - done, file.written + done);
      done += bytesWritten;
    }
    file.hash.update(data);
    file.written += data.length;
  }

  async finishCurrent() {
    const file = this.current;
    if (!file) return;
    this.current = null;
    await file.handle.close();
    file.handle = null;
    if (file.written !== file.size) {
      throw new ClientError(
        `the server sent ${file.written} bytes of ${JSON.stringify(file.path)}, announced ${file.size}`);
    }
    const digest = file.hash.digest('hex');
    if (digest !== file.sha256) {
      throw new ClientError(
        `${JSON.stringify(file.path)} arrived corrupt: SHA-256 ${digest}, announced ${file.sha256}`);
    }
  }

  /** All files arrived: move them to their names (external data first, the model last). */
  async commit() {
    await this.finishCurrent();
    if (this.files.length === 0) throw new ClientError('the server sent a report but no model');
    for (const file of [...this.files.slice(1), this.files[0]]) {
      await fsp.rename(file.temp, file.target);
      file.temp = null;
    }
    return this.files.map((f) => f.target);
  }

  /** Remove every temporary file (and folders this download created). */
  async abort() {
    for (const file of this.files) {
      if (file.handle) {
        try { await file.handle.close(); } catch { /* already closed */ }
        file.handle = null;
      }
      if (file.temp) {
        try { await fsp.unlink(file.temp); } catch { /* gone */ }
      }
    }
    // deepest first: a folder is empty only once the ones below it are gone
    const dirs = [...new Set(this.createdDirs)].sort((a, b) => b.length - a.length);
    for (const dir of dirs) {
      try { await fsp.rmdir(dir); } catch { /* not empty or gone */ }
    }
  }
}

// --- client --------------------------------------------------------------------------

class GraphoptClient {
  /**
   * @param {string} target  HOST:PORT of the server
   * @param {object} [opts]
   * @param {string} [opts.token]            sent as `authorization: Bearer <token>`
   * @param {string} [opts.tlsCaPath]        PEM file of the CA to trust; TLS when given
   * @param {number} [opts.maxMessageBytes]  largest message sent or received (default 64 MiB)
   * @param {number} [opts.chunkBytes]       data bytes per uploaded FileChunk (default 1 MiB)
   * @param {string} [opts.protoPath]        graphopt.proto (default: env GRAPHOPT_PROTO, else the repo's)
   * @param {number} [opts.deadlineSeconds]  deadline of every call (default: none)
   * @param {object} [opts.channelOptions]   extra grpc-js channel options
   */
  constructor(target, opts = {}) {
    const {
      token, tlsCaPath, maxMessageBytes = DEFAULT_MAX_MESSAGE_BYTES, chunkBytes = DEFAULT_CHUNK_BYTES,
      protoPath, deadlineSeconds, channelOptions = {},
    } = opts;
    if (!target) throw new ClientError('no server address (HOST:PORT)');
    if (!Number.isSafeInteger(chunkBytes) || chunkBytes < 1) {
      throw new ClientError(`chunkBytes must be a positive integer, not ${chunkBytes}`);
    }
    if (!Number.isSafeInteger(maxMessageBytes) || maxMessageBytes < chunkBytes + CHUNK_OVERHEAD) {
      throw new ClientError(
        `maxMessageBytes (${maxMessageBytes}) must exceed chunkBytes (${chunkBytes}) by ${CHUNK_OVERHEAD}`);
    }
    if (deadlineSeconds !== undefined && deadlineSeconds !== null &&
        !(typeof deadlineSeconds === 'number' && deadlineSeconds > 0)) {
      throw new ClientError(`deadlineSeconds must be a positive number, not ${deadlineSeconds}`);
    }
    this.target = target;
    this.token = token || null;
    this.chunkBytes = chunkBytes;
    this.maxMessageBytes = maxMessageBytes;
    this.deadlineSeconds = deadlineSeconds || null;
    this.protoPath = protoPath || process.env.GRAPHOPT_PROTO || DEFAULT_PROTO_PATH;
    this.active = new Set();   // streaming calls in flight, for cancel()

    let credentials;
    if (tlsCaPath) {
      let ca;
      try {
        ca = fs.readFileSync(tlsCaPath);
      } catch (err) {
        throw new ClientError(`cannot read the TLS CA file ${tlsCaPath}: ${err.message}`);
      }
      credentials = grpc.credentials.createSsl(ca);
    } else {
      credentials = grpc.credentials.createInsecure();
    }
    const options = {
      'grpc.max_send_message_length': maxMessageBytes,
      'grpc.max_receive_message_length': maxMessageBytes,
      ...channelOptions,
    };
    let graphoptPkg;
    try {
      graphoptPkg = loadPackage(this.protoPath);
      this.optionFields = optionFields(this.protoPath);
    } catch (err) {
      throw new ClientError(`cannot load the service definition ${this.protoPath}: ${err.message}`);
    }
    const healthPkg = loadPackage(HEALTH_PROTO_PATH);
    this.stub = new graphoptPkg.graphopt.v1.Graphopt(target, credentials, options);
    // the same channel for the health service
    this.healthStub = new healthPkg.grpc.health.v1.Health(target, null,
      { channelOverride: this.stub.getChannel() });
  }

  metadata() {
    const md = new grpc.Metadata();
    if (this.token) md.set('authorization', `Bearer ${this.token}`);
    return md;
  }

  callOptions() {
    return this.deadlineSeconds ? { deadline: new Date(Date.now() + this.deadlineSeconds * 1000) } : {};
  }

  /** The files to upload for the model at `modelPath`: the model, then its external data. */
  async uploadPlan(modelPath) {
    let stat;
    try {
      stat = await fsp.stat(modelPath);
    } catch {
      throw new ClientError(`model file ${modelPath} does not exist`);
    }
    if (!stat.isFile()) throw new ClientError(`model ${modelPath} is not a file`);
    const bytes = await fsp.readFile(modelPath);
    const modelFile = {
      path: path.basename(modelPath),
      localPath: path.resolve(modelPath),
      size: bytes.length,
      sha256: crypto.createHash('sha256').update(bytes).digest('hex'),
    };
    let external;
    try {
      external = externalDataFiles(modelPath, bytes);
    } catch (err) {
      throw toError(err);
    }
    const files = [modelFile];
    for (const ext of external) {
      files.push({ ...ext, ...(await sha256File(ext.localPath)) });
    }
    return files;
  }

  unary(stub, method, request) {
    return new Promise((resolve, reject) => {
      stub[method](request, this.metadata(), this.callOptions(), (err, response) => {
        if (err) reject(toError(err));
        else resolve(response);
      });
    });
  }

  /**
   * Optimize the model at `modelPath` on the server; write the rewritten model to
   * `outputPath` (its external-data files next to it). Returns the Report message with its
   * `json` parsed into `report.full`, and `report.files` the paths written.
   * `onProgress(stage, fraction, message)` is called for each Progress event.
   */
  async optimize(modelPath, outputPath, options = {}, onProgress = null) {
    if (!outputPath) throw new ClientError('no output path');
    const protoOptions = toProtoOptions(options, this.optionFields);
    if (protoOptions.plan) throw new ClientError('option plan is for analyze only');
    if (!protoOptions.response_chunk_bytes && this.maxMessageBytes - CHUNK_OVERHEAD < DEFAULT_CHUNK_BYTES) {
      // the server's default chunks (1 MiB) would not fit this client's message limit
      protoOptions.response_chunk_bytes = String(this.maxMessageBytes - CHUNK_OVERHEAD);
    }
    const files = await this.uploadPlan(modelPath);
    const download = new Download(outputPath);
    const uploaded = files.map((f) => path.resolve(f.localPath));
    const willWrite = path.resolve(outputPath);
    if (uploaded.includes(willWrite)) {
      throw new ClientError(`the output ${outputPath} would overwrite an input file`);
    }

    const call = this.stub.Optimize(this.metadata(), this.callOptions());
    this.active.add(call);
    const state = trackEnd(call);
    let uploadError = null;
    const uploading = upload(call, state, files, protoOptions, this.chunkBytes).catch((err) => {
      uploadError = err;
      call.cancel();
    });
    let report = null;
    try {
      try {
        for await (const message of call) {
          if (report) throw new ClientError('the server sent messages after the report');
          switch (message.item) {
            case 'progress':
              if (onProgress) onProgress(message.progress.stage, message.progress.fraction, message.progress.message);
              break;
            case 'file':
              await download.header(message.file);
              break;
            case 'chunk':
              await download.chunk(message.chunk);
              break;
            case 'report':
              report = message.report;
              break;
            default:
              throw new ClientError(`the server sent an empty OptimizeResponse (item ${message.item})`);
          }
        }
      } catch (err) {
        call.cancel();
        await uploading;
        throw uploadError || toError(err);
      }
      await uploading;
      if (uploadError) throw uploadError;
      if (!report) throw new ClientError('the server ended the call without a report');
      report.files = await download.commit();
      return parseJsonField(report);
    } catch (err) {
      await download.abort();
      throw toError(err);
    } finally {
      this.active.delete(call);
    }
  }

  /** Analyze the model at `modelPath` (same upload); the AnalyzeResponse with `full` parsed. */
  async analyze(modelPath, options = {}) {
    const protoOptions = toProtoOptions(options, this.optionFields);
    const files = await this.uploadPlan(modelPath);
    let uploadError = null;
    let call;
    const response = new Promise((resolve, reject) => {
      call = this.stub.Analyze(this.metadata(), this.callOptions(), (err, res) => {
        if (err) reject(toError(err));
        else resolve(res);
      });
    });
    this.active.add(call);
    const state = trackEnd(call);
    const uploading = upload(call, state, files, protoOptions, this.chunkBytes).catch((err) => {
      uploadError = err;
      call.cancel();
    });
    let result;
    try {
      result = await response;
    } catch (err) {
      await uploading;
      throw uploadError || err;
    } finally {
      this.active.delete(call);
    }
    await uploading;
    if (uploadError) throw uploadError;
    return parseJsonField(result);
  }

  /** [{name, description, is_default}] */
  async listStrategies() {
    const response = await this.unary(this.stub, 'ListStrategies', {});
    return response.strategies;
  }

  /** The serving status ("SERVING", "NOT_SERVING", ...) of `service` ("" = the server). */
  async health(service = '') {
    const response = await this.unary(this.healthStub, 'Check', { service });
    return response.status;
  }

  /**
   * Cancel the optimize and analyze calls in flight: each rejects with CANCELLED (the server
   * stops their work) after removing what it had written.
   */
  cancel() {
    for (const call of this.active) call.cancel();
  }

  close() {
    this.stub.close();
  }
}

module.exports = {
  GraphoptClient,
  Download,
  GraphoptError,
  ClientError,
  toProtoOptions,
  optionFields,
  camelCase,
  loadPackage,
  DEFAULT_PROTO_PATH,
  HEALTH_PROTO_PATH,
  LOADER_OPTIONS,
  STATUS_NAMES,
};
