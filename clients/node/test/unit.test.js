'use strict';
// Unit checks that need no server: `node --test clients/node/test/`
// (tests/test_node_client.py runs them too).

const test = require('node:test');
const assert = require('node:assert');
const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const path = require('path');

const { parseCommandLine, parseBytes, parseInputDims, progressLine, run } = require('../bin/graphopt-node');
const { toProtoOptions, loadPackage, DEFAULT_PROTO_PATH, HEALTH_PROTO_PATH, GraphoptClient, ClientError } = require('../src/client');
const { resolveLocation, externalDataFiles, ExternalDataError } = require('../src/onnx_refs');

test('the service definitions load', () => {
  const pkg = loadPackage(DEFAULT_PROTO_PATH);
  const service = pkg.graphopt.v1.Graphopt.service;
  assert.deepStrictEqual(Object.keys(service).sort(), ['Analyze', 'ListStrategies', 'Optimize']);
  assert.strictEqual(service.Optimize.requestStream, true);
  assert.strictEqual(service.Optimize.responseStream, true);
  assert.strictEqual(service.Analyze.requestStream, true);
  assert.strictEqual(service.Analyze.responseStream, false);
  const health = loadPackage(HEALTH_PROTO_PATH).grpc.health.v1.Health.service;
  assert.strictEqual(health.Check.path, '/grpc.health.v1.Health/Check');
});

test('options map onto graphopt.v1.OptimizeOptions', () => {
  assert.deepStrictEqual(toProtoOptions({}), {});
  assert.deepStrictEqual(toProtoOptions({
    budgetBytes: 512 * 2 ** 20, strategy: 'feng-huang', inputDims: { x: [8, 3, 32, 32], s: [] },
    verify: false, measure: false, loss: 'loss', threads: 2, providers: ['CPUExecutionProvider'], tolerance: 1e-4,
  }), {
    budget_bytes: '536870912', strategy: 'feng-huang',
    input_dims: [{ name: 'x', dims: ['8', '3', '32', '32'] }, { name: 's', dims: [] }],
    verify: false, measure: false, loss: 'loss', threads: 2,
    providers: ['CPUExecutionProvider'], tolerance: 1e-4,
  });
  assert.throws(() => toProtoOptions({ executionProvider: 'CPUExecutionProvider' }), /unknown option/);
  assert.throws(() => toProtoOptions({ tolerance: -1 }), /tolerance must be/);
  assert.deepStrictEqual(toProtoOptions({ budgetBytes: 0 }), { budget_bytes: '0' });
  assert.throws(() => toProtoOptions({ budget: 5 }), /unknown option "budget"/);
  assert.throws(() => toProtoOptions({ budgetBytes: -1 }), /non-negative integer/);
  // an encodable message
  const pkg = loadPackage(DEFAULT_PROTO_PATH);
  const Request = pkg.graphopt.v1.Graphopt.service.Optimize.requestSerialize;
  const bytes = Request({ options: toProtoOptions({ budgetBytes: 2 ** 40, inputDims: { x: [1] } }) });
  const back = pkg.graphopt.v1.Graphopt.service.Optimize.requestDeserialize(bytes);
  assert.strictEqual(back.item, 'options');
  assert.strictEqual(back.options.budget_bytes, String(2 ** 40));
  assert.deepStrictEqual(back.options.input_dims[0].dims, ['1']);
  const unset = pkg.graphopt.v1.Graphopt.service.Optimize.requestDeserialize(Request({ options: {} }));
  assert.strictEqual(unset.options.budget_bytes, undefined, 'an unset budget stays unset (proto3 optional)');
  assert.strictEqual(unset.options.objective, undefined, 'an unset objective stays unset (proto3 optional)');
  assert.strictEqual(unset.options.max_overhead, undefined, 'an unset max overhead stays unset');
  // objective and maxOverhead: sent as given (a zero overhead too); the server checks the name
  assert.deepStrictEqual(toProtoOptions({ objective: 'least-peak' }), { objective: 'least-peak' });
  assert.deepStrictEqual(toProtoOptions({ objective: 'fastest' }), { objective: 'fastest' });
  assert.deepStrictEqual(toProtoOptions({ maxOverhead: 0 }), { max_overhead: 0 });
  assert.deepStrictEqual(toProtoOptions({ maxOverhead: '0.25' }), { max_overhead: 0.25 });
  for (const bad of [-0.1, 'soon', Infinity, true]) {
    assert.throws(() => toProtoOptions({ maxOverhead: bad }), /maxOverhead must be a finite number >= 0/, String(bad));
  }
  const zero = pkg.graphopt.v1.Graphopt.service.Optimize.requestDeserialize(
    Request({ options: toProtoOptions({ objective: 'bounded-overhead', maxOverhead: 0 }) }));
  assert.strictEqual(zero.options.objective, 'bounded-overhead');
  assert.strictEqual(zero.options.max_overhead, 0, 'a zero max overhead is sent (presence)');
});

test('byte sizes and input dims read like graphopt\'s CLI', () => {
  assert.strictEqual(parseBytes('123'), 123);
  assert.strictEqual(parseBytes('512MiB'), 512 * 2 ** 20);
  assert.strictEqual(parseBytes('1.5GiB'), 1.5 * 2 ** 30);
  assert.strictEqual(parseBytes('2GB'), 2e9);
  assert.throws(() => parseBytes('12 parsecs'), /not a byte size/);
  assert.throws(() => parseBytes('-3'), /not a byte size/);
  assert.deepStrictEqual(parseInputDims(['x=8,3,32,32', 'y=']), { x: [8, 3, 32, 32], y: [] });
  assert.throws(() => parseInputDims(['x']), /expected NAME=/);
  assert.throws(() => parseInputDims(['=3']), /name is empty/);
  assert.throws(() => parseInputDims(['x=1', 'x=2']), /given twice/);
  assert.throws(() => parseInputDims(['x=1,-2']), /not a non-negative integer/);
});

test('command lines', () => {
  const p = parseCommandLine(['optimize', 'm.onnx', '-o', 'out.onnx', '--server', '127.0.0.1:5',
    '--budget', '64MiB', '--strategy', 'chen-sqrt', '--input-dims', 'x=2,3', '--input-dims', 'y=2',
    '--loss', 'L', '--no-verify', '--no-measure', '--report', 'r.json', '--token', 't0k',
    '--tls-ca', 'ca.pem', '--deadline-seconds', '30']);
  assert.strictEqual(p.command, 'optimize');
  assert.strictEqual(p.model, 'm.onnx');
  assert.strictEqual(p.output, 'out.onnx');
  assert.strictEqual(p.server, '127.0.0.1:5');
  assert.strictEqual(p.report, 'r.json');
  assert.deepStrictEqual(p.options, { budgetBytes: 64 * 2 ** 20, strategy: 'chen-sqrt',
    inputDims: { x: [2, 3], y: [2] }, loss: 'L', verify: false, measure: false });
  assert.deepStrictEqual(p.clientOptions, { token: 't0k', tlsCaPath: 'ca.pem', protoPath: undefined,
    deadlineSeconds: 30 });
  assert.deepStrictEqual(parseCommandLine(['analyze', 'm.onnx', '--server', 'h:1', '--plan']).options, { plan: true });
  assert.deepStrictEqual(parseCommandLine(['optimize', 'm.onnx', '-o', 'o.onnx', '--server', 'h:1',
    '--objective', 'least-peak']).options, { objective: 'least-peak' });
  assert.deepStrictEqual(parseCommandLine(['analyze', 'm.onnx', '--server', 'h:1', '--plan',
    '--max-overhead', '0.1']).options, { maxOverhead: 0.1, plan: true });
  assert.strictEqual(parseCommandLine(['health', '--server', 'h:1']).command, 'health');
  assert.strictEqual(parseCommandLine(['strategies', '--help']).command, 'help');
  for (const [argv, message] of [
    [['frobnicate'], /unknown command/],
    [['optimize', 'm.onnx', '--server', 'h:1'], /-o OUT/],
    [['optimize', '-o', 'x', '--server', 'h:1'], /one MODEL/],
    [['strategies', '--server', 'h:1', 'extra'], /no positional/],
    [['strategies', '--bogus', '--server', 'h:1'], /bogus/],
    [['analyze', 'm.onnx', '--server', 'h:1', '--no-frobnicate'], /no-frobnicate/],
    [['strategies', '--server', 'h:1', '--budget', '1'], /budget/],
    [['optimize', 'm', '-o', 'x', '--server', 'h:1', '--deadline-seconds', 'soon'], /not a positive number/],
    [['optimize', 'm', '-o', 'x', '--server', 'h:1', '--max-overhead=-1'], /--max-overhead: not a number >= 0/],
    [['optimize', 'm', '-o', 'x', '--server', 'h:1', '--max-overhead', '10%'], /--max-overhead: not a number >= 0/],
  ]) {
    assert.throws(() => parseCommandLine(argv), message, argv.join(' '));
  }
  const saved = process.env.GRAPHOPT_SERVER;
  delete process.env.GRAPHOPT_SERVER;
  try {
    assert.throws(() => parseCommandLine(['health']), /--server/);
  } finally {
    if (saved !== undefined) process.env.GRAPHOPT_SERVER = saved;
  }
  assert.strictEqual(progressLine('plan', 0.4, ''), '[ 40%] plan');
  assert.strictEqual(progressLine('done', 1, 'ok'), '[100%] done: ok');
});

test('usage errors exit 1, with the error on stderr', async () => {
  const out = [];
  const err = [];
  const io = { stdout: { write: (s) => out.push(s) }, stderr: { write: (s) => err.push(s) } };
  assert.strictEqual(await run(['optimize', 'm.onnx', '--server', 'h:1'], io), 1);
  assert.match(err.join(''), /^error: optimize needs -o OUT/);
  assert.strictEqual(await run(['--help'], io), 0);
  assert.match(out.join(''), /usage:/);
});

test('external-data locations stay inside the model folder', () => {
  const dir = path.resolve('/models/m');
  assert.strictEqual(resolveLocation(dir, 'weights.bin', 't'), path.join(dir, 'weights.bin'));
  assert.strictEqual(resolveLocation(dir, 'data/w.bin', 't'), path.join(dir, 'data', 'w.bin'));
  assert.strictEqual(resolveLocation(dir, './a/../w.bin', 't'), path.join(dir, 'w.bin'));
  assert.throws(() => resolveLocation(dir, '/etc/passwd', 't'), /is absolute/);
  assert.throws(() => resolveLocation(dir, 'C:\\w.bin', 't'), /is absolute/);
  assert.throws(() => resolveLocation(dir, '../w.bin', 't'), /outside the model's folder/);
  assert.throws(() => resolveLocation(dir, 'a/../../w.bin', 't'), /outside the model's folder/);
  assert.throws(() => resolveLocation(dir, '.', 't'), /outside the model's folder/);
  assert.throws(() => resolveLocation(dir, '', 't'), /without a location/);
});

test('bytes that are not protobuf reference no files', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'graphopt-node-'));
  try {
    const file = path.join(dir, 'm.onnx');
    fs.writeFileSync(file, 'this is not an ONNX model\n');
    assert.deepStrictEqual(externalDataFiles(file), []);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('client settings are checked', () => {
  assert.throws(() => new GraphoptClient('h:1', { chunkBytes: 0 }), ClientError);
  assert.throws(() => new GraphoptClient('h:1', { chunkBytes: 2 ** 20, maxMessageBytes: 2 ** 20 }), /maxMessageBytes/);
  assert.throws(() => new GraphoptClient('h:1', { tlsCaPath: '/nonexistent/ca.pem' }), /TLS CA file/);
  assert.throws(() => new GraphoptClient('h:1', { protoPath: '/nonexistent/x.proto' }), /service definition/);
  const client = new GraphoptClient('h:1', { chunkBytes: 4096, token: 'abc' });
  assert.strictEqual(client.metadata().get('authorization')[0], 'Bearer abc');
  client.close();
});

test('an upload plan lists the model then each distinct external file with size and sha256', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'graphopt-node-'));
  try {
    // A hand-encoded ModelProto: graph{initializer{external_data{location=...}, data_location=1}} x3,
    // two of them naming the same file.
    const protobuf = require('protobufjs');
    const { PARTIAL_ONNX } = require('../src/onnx_refs');
    const Model = protobuf.parse(PARTIAL_ONNX, { keepCase: true }).root.lookupType('graphopt_partial_onnx.ModelProto');
    const tensor = (name, location) => ({ name, data_location: 1,
      external_data: [{ key: 'location', value: location }, { key: 'offset', value: '0' }] });
    const bytes = Model.encode(Model.fromObject({ graph: {
      initializer: [tensor('a', 'w.bin'), tensor('b', './w.bin'), tensor('c', 'sub/v.bin')],
      node: [{ attribute: [{ name: 'value', t: tensor('d', 'sub/v.bin') }] }],
    } })).finish();
    fs.writeFileSync(path.join(dir, 'm.onnx'), bytes);
    fs.writeFileSync(path.join(dir, 'w.bin'), Buffer.alloc(10, 1));
    fs.mkdirSync(path.join(dir, 'sub'));
    fs.writeFileSync(path.join(dir, 'sub', 'v.bin'), Buffer.alloc(3, 2));
    const client = new GraphoptClient('h:1');
    const plan = await client.uploadPlan(path.join(dir, 'm.onnx'));
    client.close();
    const sha = (b) => crypto.createHash('sha256').update(b).digest('hex');
    assert.deepStrictEqual(plan.map((f) => [f.path, f.size, f.sha256]), [
      ['m.onnx', bytes.length, sha(bytes)],
      ['w.bin', 10, sha(Buffer.alloc(10, 1))],
      ['sub/v.bin', 3, sha(Buffer.alloc(3, 2))],
    ]);
    fs.rmSync(path.join(dir, 'sub', 'v.bin'));
    assert.throws(() => externalDataFiles(path.join(dir, 'm.onnx')), /"sub\/v.bin" does not exist/);
    const escaping = Model.encode(Model.fromObject({ graph: { initializer: [tensor('e', '../x.bin')] } })).finish();
    fs.writeFileSync(path.join(dir, 'e.onnx'), escaping);
    assert.throws(() => externalDataFiles(path.join(dir, 'e.onnx')), ExternalDataError);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

// --- a scripted in-process server: what the client does with bad responses -------------

const grpc = require('@grpc/grpc-js');

function sha(buffer) {
  return crypto.createHash('sha256').update(buffer).digest('hex');
}

/** A Graphopt server whose Optimize records the upload, then sends `script(upload)`. */
async function scriptedServer(script) {
  const pkg = loadPackage(DEFAULT_PROTO_PATH);
  const server = new grpc.Server();
  const seen = { uploads: [], metadata: [] };
  server.addService(pkg.graphopt.v1.Graphopt.service, {
    Optimize(call) {
      const upload = [];
      seen.metadata.push(call.metadata.get('authorization'));
      call.on('data', (m) => upload.push(m));
      call.on('end', () => {
        seen.uploads.push(upload);
        const replies = script(upload);
        for (const reply of replies) {
          if (reply.status) {
            call.emit('error', { code: reply.status, details: reply.details });
            return;
          }
          call.write(reply);
        }
        call.end();
      });
    },
    Analyze(call, callback) { callback({ code: grpc.status.UNIMPLEMENTED, details: 'not here' }); },
    ListStrategies(call, callback) {
      callback(null, { strategies: [{ name: 'auto', description: 'd', is_default: true }] });
    },
  });
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0',
    grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))));
  return { target: `127.0.0.1:${port}`, seen, close: () => server.forceShutdown() };
}

function fileReplies(path_, data, chunkBytes = 3, overrides = {}) {
  const replies = [{ file: { path: path_, size_bytes: String(data.length), sha256: sha(data), ...overrides } }];
  for (let offset = 0; offset < data.length; offset += chunkBytes) {
    replies.push({ chunk: { offset: String(offset), data: data.subarray(offset, offset + chunkBytes) } });
  }
  return replies;
}

const REPORT = { report: { strategy: 'auto', checkpoints: 2, json: '{"strategy": "auto", "checkpoints": ["a", "b"]}' } };

test('optimize against a scripted server: upload as the contract says, downloads checked and atomic', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'graphopt-node-'));
  const model = Buffer.from('model bytes: any, the scripted server does not parse them');
  fs.writeFileSync(path.join(dir, 'm.onnx'), model);
  const good = Buffer.from('rewritten model');
  const extra = Buffer.from('external data of the rewritten model');
  let replies = [];
  const srv = await scriptedServer(() => replies);
  const client = new GraphoptClient(srv.target, { chunkBytes: 7, token: 'tok' });
  t.after(() => { client.close(); srv.close(); fs.rmSync(dir, { recursive: true, force: true }); });
  const listing = () => fs.readdirSync(path.join(dir, 'out'), { recursive: true }).sort();

  // a good answer: progress, two files, the report
  replies = [{ progress: { stage: 'plan', fraction: 0.4, message: '' } },
    ...fileReplies('optimized.onnx', good), ...fileReplies('data/w.bin', extra), REPORT];
  const events = [];
  const report = await client.optimize(path.join(dir, 'm.onnx'), path.join(dir, 'out', 'o.onnx'),
    { strategy: 'auto', measure: false }, (...e) => events.push(e));
  assert.deepStrictEqual(events, [['plan', 0.4, '']]);
  assert.deepStrictEqual(report.full, { strategy: 'auto', checkpoints: ['a', 'b'] });
  assert.strictEqual(report.checkpoints, 2);
  assert.deepStrictEqual(report.files, [path.join(dir, 'out', 'o.onnx'), path.join(dir, 'out', 'data', 'w.bin')]);
  assert.deepStrictEqual(fs.readFileSync(path.join(dir, 'out', 'o.onnx')), good);
  assert.deepStrictEqual(fs.readFileSync(path.join(dir, 'out', 'data', 'w.bin')), extra);
  assert.deepStrictEqual(srv.seen.metadata[0], ['Bearer tok']);
  const upload = srv.seen.uploads[0];
  assert.strictEqual(upload[0].item, 'options');
  assert.strictEqual(upload[0].options.strategy, 'auto');
  assert.strictEqual(upload[0].options.measure, false);
  assert.strictEqual(upload[0].options.budget_bytes, undefined);
  assert.deepStrictEqual(upload[1].file, { path: 'm.onnx', size_bytes: String(model.length), sha256: sha(model) });
  const chunks = upload.slice(2).map((m) => m.chunk);
  assert.deepStrictEqual(chunks.map((c) => Number(c.offset)), [...Array(Math.ceil(model.length / 7)).keys()].map((i) => i * 7));
  assert.deepStrictEqual(Buffer.concat(chunks.map((c) => c.data)), model);

  // bad answers leave nothing behind (no temporary files, no new folders)
  fs.rmSync(path.join(dir, 'out'), { recursive: true });
  const bad = [
    [[...fileReplies('optimized.onnx', good), ...fileReplies('../escape.bin', extra), REPORT], /outside the output folder/],
    [[...fileReplies('optimized.onnx', good), ...fileReplies('/abs.bin', extra), REPORT], /invalid path/],
    [[...fileReplies('optimized.onnx', good, 3, { sha256: sha(extra) }), REPORT], /arrived corrupt/],
    [[...fileReplies('optimized.onnx', good, 3, { size_bytes: String(good.length + 1) }), REPORT], /sent 15 bytes .* announced 16/],
    [[...fileReplies('optimized.onnx', good).filter((_, i) => i !== 2), REPORT], /out of order/],
    [[...fileReplies('optimized.onnx', good), ...fileReplies('sub/x.bin', extra), ...fileReplies('sub/x.bin', extra), REPORT], /twice/],
    [[...fileReplies('optimized.onnx', good)], /without a report/],
    [[REPORT], /report but no model/],
    [[...fileReplies('optimized.onnx', good), ...fileReplies('sub/x.bin', extra), { status: grpc.status.INVALID_ARGUMENT, details: 'no good' }], /INVALID_ARGUMENT: no good/],
  ];
  for (const [script, message] of bad) {
    replies = script;
    await assert.rejects(client.optimize(path.join(dir, 'm.onnx'), path.join(dir, 'out', 'deeper', 'o.onnx')), message);
    assert.ok(!fs.existsSync(path.join(dir, 'out')), `${message}: left ${fs.existsSync(path.join(dir, 'out')) && listing()}`);
  }
  // an existing output folder is kept, and so is an earlier output
  fs.mkdirSync(path.join(dir, 'out'));
  fs.writeFileSync(path.join(dir, 'out', 'o.onnx'), 'earlier');
  replies = [...fileReplies('optimized.onnx', good, 3, { sha256: sha(extra) }), REPORT];
  await assert.rejects(client.optimize(path.join(dir, 'm.onnx'), path.join(dir, 'out', 'o.onnx')), /corrupt/);
  assert.deepStrictEqual(listing(), ['o.onnx']);
  assert.strictEqual(fs.readFileSync(path.join(dir, 'out', 'o.onnx'), 'utf8'), 'earlier');

  // refusing to overwrite the input
  await assert.rejects(client.optimize(path.join(dir, 'm.onnx'), path.join(dir, 'm.onnx')), /overwrite an input/);
  assert.deepStrictEqual(await client.listStrategies(), [{ name: 'auto', description: 'd', is_default: true }]);
  await assert.rejects(client.analyze(path.join(dir, 'm.onnx')), (err) => err.codeName === 'UNIMPLEMENTED');
});

test('a server that refuses mid-upload ends the call at once (no hang on a full send buffer)', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'graphopt-node-'));
  fs.writeFileSync(path.join(dir, 'big.onnx'), crypto.randomBytes(4 << 20));
  const pkg = loadPackage(DEFAULT_PROTO_PATH);
  const server = new grpc.Server();
  let received = 0;
  const refuse = (call, send) => {
    call.on('data', () => {
      received += 1;
      if (received === 3) send({ code: grpc.status.RESOURCE_EXHAUSTED, details: 'too big for this test' });
    });
  };
  server.addService(pkg.graphopt.v1.Graphopt.service, {
    Optimize(call) { refuse(call, (e) => call.emit('error', e)); },
    Analyze(call, callback) { refuse(call, (e) => callback(e)); },
    ListStrategies(call, callback) { callback(null, { strategies: [] }); },
  });
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0',
    grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))));
  const client = new GraphoptClient(`127.0.0.1:${port}`, { chunkBytes: 1024 });
  t.after(() => { client.close(); server.forceShutdown(); fs.rmSync(dir, { recursive: true, force: true }); });
  const started = Date.now();
  await assert.rejects(client.optimize(path.join(dir, 'big.onnx'), path.join(dir, 'o.onnx')),
    (err) => err.codeName === 'RESOURCE_EXHAUSTED' && /too big/.test(err.message));
  received = 0;
  await assert.rejects(client.analyze(path.join(dir, 'big.onnx')),
    (err) => err.codeName === 'RESOURCE_EXHAUSTED');
  assert.ok(Date.now() - started < 10000);
  assert.deepStrictEqual(fs.readdirSync(dir), ['big.onnx']);
});
