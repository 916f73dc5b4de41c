#!/usr/bin/env node
'use strict';
// graphopt-node: command line of the graphopt gRPC service (Node.js client).
// Exit status: 0 ok, 1 usage or local error, 2 the server answered with an error status,
// 3 (health) the server is not SERVING, 130 interrupted (SIGINT/SIGTERM: the call is cancelled
// and a partial download removed).

const fs = require('fs');
const path = require('path');
const { parseArgs } = require('util');
const { GraphoptClient, GraphoptError, optionFields, DEFAULT_PROTO_PATH } = require('../src/client');

const USAGE = `usage:
  graphopt-node optimize MODEL -o OUT --server HOST:PORT [--report FILE] [OPTION]...
  graphopt-node analyze MODEL --server HOST:PORT [--plan] [OPTION]...
  graphopt-node strategies --server HOST:PORT
  graphopt-node health --server HOST:PORT [--service NAME]

common options:
  --server HOST:PORT         the graphopt server (or env GRAPHOPT_SERVER)
  --token T                  bearer token (or --token-file FILE, or env GRAPHOPT_TOKEN)
  --tls-ca FILE              use TLS, trusting the CA certificate in FILE (PEM)
  --deadline-seconds N       give up after N seconds (DEADLINE_EXCEEDED)
  --chunk-bytes N            upload chunk size (default 1 MiB)
  --max-message-bytes N      largest gRPC message sent or received (default 64 MiB)
  --proto FILE               graphopt.proto (default: env GRAPHOPT_PROTO, else the repository's)
  -h, --help                 this help

optimize and analyze, OPTION: each field of graphopt.v1.OptimizeOptions in the proto (graphopt's
OptimizeOptions, graphopt/options.py: see graphopt optimize --help for what each means), as a flag
named after the field: --budget BYTES (budget_bytes: a *_bytes field drops _bytes), --memory-limit
BYTES, --objective O, --max-overhead F, --strategy S, --input-dims NAME=D1,D2,... (repeatable),
--provider P (providers; repeatable), --verify/--no-verify, --measure/--no-measure, --loss NAME,
--threads N, --graph-optimizations L, --tolerance F, ...; for example:
  --memory-limit BYTES       optimize: what the training session may hold at once on its device
                             (weights, state, the step); the returned model is run under it
  --objective O              without --budget: bounded-overhead (the server's default: the least
                             peak within --max-overhead) or least-peak (whatever it costs in time)
  --max-overhead F           step time at most (1 + F) x the original's, measured in ONNX Runtime's
                             default session (unset: the server's default, 0.25, without --budget)
  --graph-optimizations L    ONNX Runtime's graph optimizations applied before planning: none, basic
                             or extended (unset: the server's default, extended on the CPU provider)

BYTES: 123, 500MB, 512MiB, 1.5GiB`;

const COMMON = {
  server: { type: 'string' },
  token: { type: 'string' },
  'token-file': { type: 'string' },
  'tls-ca': { type: 'string' },
  'deadline-seconds': { type: 'string' },
  'chunk-bytes': { type: 'string' },
  'max-message-bytes': { type: 'string' },
  proto: { type: 'string' },
  help: { type: 'boolean', short: 'h' },
};

// The fields of OptimizeOptions that are the service's own, not graphopt's options (analyze's
// --plan is its own flag).
const SERVICE_FIELDS = new Set(['response_chunk_bytes', 'plan']);
// Flags named otherwise than by the rule of optionFlags (as graphopt's CLI names them).
const FLAG_STEMS = { providers: 'provider' };

const COMMANDS = {
  optimize: {
    positionals: 1,
    options: { ...COMMON, output: { type: 'string', short: 'o' }, report: { type: 'string' } },
  },
  analyze: { positionals: 1, options: { ...COMMON, plan: { type: 'boolean' } } },
  strategies: { positionals: 0, options: { ...COMMON } },
  health: { positionals: 0, options: { ...COMMON, service: { type: 'string' } } },
};
const OPTION_COMMANDS = new Set(['optimize', 'analyze']);

class UsageError extends Error {}

const UNITS = { '': 1, b: 1, kb: 1e3, mb: 1e6, gb: 1e9, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30 };

/** '123', '200MB', '1.5GiB' -> bytes (as graphopt's own CLI reads them). */
function parseBytes(text) {
  const match = /^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$/.exec(text);
  if (!match || !(match[2].toLowerCase() in UNITS)) {
    throw new UsageError(`not a byte size: ${JSON.stringify(text)} (e.g. 500000000, 512MiB, 2GB)`);
  }
  return Math.floor(parseFloat(match[1]) * UNITS[match[2].toLowerCase()]);
}

function parsePositiveInt(text, flag) {
  if (!/^\s*[0-9]+\s*$/.test(text) || Number(text) < 1 || !Number.isSafeInteger(Number(text))) {
    throw new UsageError(`${flag}: not a positive integer: ${JSON.stringify(text)}`);
  }
  return Number(text);
}

function parseFraction(text, flag) {
  const value = Number(text);
  if (text.trim() === '' || !Number.isFinite(value) || value < 0) {
    throw new UsageError(`${flag}: not a number >= 0 (0.1: 10% slower at most): ${JSON.stringify(text)}`);
  }
  return value;
}

function parsePositiveNumber(text, flag) {
  const value = Number(text);
  if (text.trim() === '' || !Number.isFinite(value) || value <= 0) {
    throw new UsageError(`${flag}: not a positive number: ${JSON.stringify(text)}`);
  }
  return value;
}

/** ["x=8,3,32,32", "y="] -> {x: [8,3,32,32], y: []} (as graphopt.inputs.parse_input_dims). */
function parseInputDims(specs) {
  const out = {};
  for (const spec of specs || []) {
    const at = spec.lastIndexOf('=');
    if (at < 0) throw new UsageError(`--input-dims ${JSON.stringify(spec)}: expected NAME=D0,D1,... (for example x=8,3,32,32)`);
    const name = spec.slice(0, at).trim();
    const dimsText = spec.slice(at + 1).trim();
    if (!name) throw new UsageError(`--input-dims ${JSON.stringify(spec)}: the input name is empty`);
    if (Object.prototype.hasOwnProperty.call(out, name)) {
      throw new UsageError(`--input-dims: input ${JSON.stringify(name)} is given twice`);
    }
    const dims = [];
    if (dimsText) {
      for (const part of dimsText.split(',')) {
        const p = part.trim();
        if (!/^[0-9]+$/.test(p)) {
          throw new UsageError(`--input-dims ${JSON.stringify(spec)}: dimension ${JSON.stringify(p)} is not a non-negative integer`);
        }
        dims.push(Number(p));
      }
    }
    // an own property whatever the name: `out[name] =` would set the prototype for "__proto__"
    Object.defineProperty(out, name, { value: dims, enumerable: true, writable: true, configurable: true });
  }
  return out;
}

function parseCount(text, flag) {
  if (!/^\s*[0-9]+\s*$/.test(text) || !Number.isSafeInteger(Number(text))) {
    throw new UsageError(`${flag}: not a non-negative integer: ${JSON.stringify(text)}`);
  }
  return Number(text);
}

/**
 * The option flags of graphopt.v1.OptimizeOptions' fields (`fields`: the client's optionFields),
 * the same rule as graphopt's CLI (graphopt.options.flag_name): the field's name in kebab-case, a
 * *_bytes int64 without "-bytes" and read as BYTES; a bool both as --NAME and --no-NAME; a
 * repeated field repeatable. -> [{flag, key, spec (for util.parseArgs), parse(value, flag)}]
 */
function optionFlags(fields) {
  const flags = [];
  for (const field of fields) {
    if (SERVICE_FIELDS.has(field.name)) continue;
    const bytes = /INT64$/.test(field.type) && field.name.endsWith('_bytes');
    const stem = FLAG_STEMS[field.name] || (bytes ? field.name.slice(0, -'_bytes'.length) : field.name).replace(/_/g, '-');
    if (field.type === 'TYPE_BOOL' && !field.repeated) {
      flags.push({ flag: stem, key: field.key, spec: { type: 'boolean' }, parse: () => true });
      flags.push({ flag: `no-${stem}`, key: field.key, spec: { type: 'boolean' }, parse: () => false });
      continue;
    }
    let one;
    if (field.type === 'TYPE_MESSAGE' && field.typeName.endsWith('InputDims')) one = null;
    else if (bytes) one = (text) => parseBytes(text);
    else if (/INT64$|INT32$/.test(field.type)) one = field.name === 'threads' ? parsePositiveInt : parseCount;
    else if (field.type === 'TYPE_DOUBLE' || field.type === 'TYPE_FLOAT') one = parseFraction;
    else if (field.type === 'TYPE_STRING') one = (text) => text;
    else continue;   // a type without a flag form: the library API still takes it
    const parse = one === null ? (values) => parseInputDims(values)
      : field.repeated ? (values, flag) => values.map((v) => one(v, flag)) : one;
    flags.push({ flag: stem, key: field.key, spec: { type: 'string', multiple: field.repeated }, parse });
  }
  return flags;
}

/** The proto a command line names: --proto FILE, else $GRAPHOPT_PROTO, else the repository's. */
function protoPathOf(argv) {
  for (let i = 0; i < argv.length; i += 1) {
    if (argv[i] === '--proto' && i + 1 < argv.length) return argv[i + 1];
    if (argv[i].startsWith('--proto=')) return argv[i].slice('--proto='.length);
  }
  return process.env.GRAPHOPT_PROTO || DEFAULT_PROTO_PATH;
}

/** argv (without node and the script) -> {command, model, values}; throws UsageError. */
function parseCommandLine(argv) {
  if (argv.length === 0) throw new UsageError('no command (optimize, analyze, strategies, health)');
  if (argv[0] === '-h' || argv[0] === '--help' || argv[0] === 'help') return { command: 'help' };
  const command = argv[0];
  const spec = COMMANDS[command];
  if (!spec) throw new UsageError(`unknown command ${JSON.stringify(command)} (optimize, analyze, strategies, health)`);
  let flags = [];
  if (OPTION_COMMANDS.has(command)) {
    const protoPath = protoPathOf(argv);
    try {
      flags = optionFlags(optionFields(protoPath));
    } catch (err) {
      throw new UsageError(`--proto: cannot read graphopt.v1.OptimizeOptions from ${protoPath}: ${err.message}`);
    }
  }
  const flagSpecs = Object.fromEntries(flags.map((f) => [f.flag, f.spec]));
  let parsed;
  try {
    parsed = parseArgs({ args: argv.slice(1), options: { ...flagSpecs, ...spec.options }, allowPositionals: true,
      strict: true });
  } catch (err) {
    throw new UsageError(err.message);
  }
  const { values, positionals } = parsed;
  if (values.help) return { command: 'help' };
  if (positionals.length !== spec.positionals) {
    throw new UsageError(spec.positionals
      ? `${command} takes one MODEL file (got ${positionals.length} arguments)`
      : `${command} takes no positional arguments (got ${positionals.join(' ')})`);
  }
  const server = values.server || process.env.GRAPHOPT_SERVER;
  if (!server) throw new UsageError('--server HOST:PORT is required (or set GRAPHOPT_SERVER)');
  if (values.token && values['token-file']) throw new UsageError('give --token or --token-file, not both');
  let token = values.token;
  if (values['token-file']) {
    try {
      token = fs.readFileSync(values['token-file'], 'utf8').trim();
    } catch (err) {
      throw new UsageError(`--token-file: cannot read ${values['token-file']}: ${err.message}`);
    }
    if (!token) throw new UsageError(`--token-file: ${values['token-file']} is empty`);
  }
  const clientOptions = {
    token: token || process.env.GRAPHOPT_TOKEN || undefined,
    tlsCaPath: values['tls-ca'],
    protoPath: values.proto,
  };
  if (values['deadline-seconds'] !== undefined) {
    clientOptions.deadlineSeconds = parsePositiveNumber(values['deadline-seconds'], '--deadline-seconds');
  }
  if (values['chunk-bytes'] !== undefined) clientOptions.chunkBytes = parseBytes(values['chunk-bytes']);
  if (values['max-message-bytes'] !== undefined) clientOptions.maxMessageBytes = parseBytes(values['max-message-bytes']);

  const options = {};
  for (const f of flags) {
    if (values[f.flag] !== undefined) options[f.key] = f.parse(values[f.flag], `--${f.flag}`);
  }
  if (command === 'optimize' && !values.output) throw new UsageError('optimize needs -o OUT');
  if (command === 'analyze' && values.plan) options.plan = true;
  return {
    command, server, clientOptions, options,
    model: positionals[0], output: values.output, report: values.report, service: values.service || '',
  };
}

/** 123 B, 4.5 KiB, 12.0 MiB, 1.50 GiB */
function human(bytes) {
  const n = Number(bytes);
  if (n < 2 ** 10) return `${n} B`;
  if (n < 2 ** 20) return `${(n / 2 ** 10).toFixed(1)} KiB`;
  if (n < 2 ** 30) return `${(n / 2 ** 20).toFixed(1)} MiB`;
  return `${(n / 2 ** 30).toFixed(2)} GiB`;
}

function progressLine(stage, fraction, message) {
  const pct = String(Math.round(Math.max(0, Math.min(1, fraction)) * 100)).padStart(3);
  return `[${pct}%] ${stage}${message ? ': ' + message : ''}`;
}

/** The files written, then the server's summary: graphopt's one renderer (graphopt.report.summary_text). */
function summary(report) {
  return [`wrote ${report.files.join(', ')}`, report.summary].join('\n');
}

async function run(argv, io = { stdout: process.stdout, stderr: process.stderr }) {
  let parsed;
  try {
    parsed = parseCommandLine(argv);
  } catch (err) {
    if (!(err instanceof UsageError)) throw err;
    io.stderr.write(`error: ${err.message}\n(graphopt-node --help shows the usage)\n`);
    return 1;
  }
  if (parsed.command === 'help') {
    io.stdout.write(USAGE + '\n');
    return 0;
  }
  let client;
  let interrupted = null;
  const onSignal = (signal) => {
    interrupted = signal;
    if (client) client.cancel();
  };
  if (io.handleSignals) {
    process.on('SIGINT', onSignal);
    process.on('SIGTERM', onSignal);
  }
  try {
    client = new GraphoptClient(parsed.server, parsed.clientOptions);
    switch (parsed.command) {
      case 'optimize': {
        const report = await client.optimize(parsed.model, parsed.output, parsed.options,
          (stage, fraction, message) => io.stderr.write(progressLine(stage, fraction, message) + '\n'));
        if (parsed.report) {
          fs.writeFileSync(parsed.report, JSON.stringify(report.full, null, 2) + '\n');
        }
        io.stdout.write(summary(report) + '\n');
        if (parsed.report) io.stdout.write(`report: ${parsed.report}\n`);
        return 0;
      }
      case 'analyze': {
        const response = await client.analyze(parsed.model, parsed.options);
        const out = { ...response };
        delete out.json;
        io.stdout.write(JSON.stringify(out, null, 2) + '\n');
        // where the peak falls and what bounds it, for the eye (graphopt's renderer, on the server)
        if (response.peak_summary) io.stderr.write(response.peak_summary + '\n');
        return 0;
      }
      case 'strategies': {
        const strategies = await client.listStrategies();
        const width = Math.max(0, ...strategies.map((s) => s.name.length));
        for (const s of strategies) {
          io.stdout.write(`${s.name.padEnd(width)}  ${s.is_default ? '(default) ' : ''}${s.description}\n`);
        }
        return 0;
      }
      case 'health': {
        const status = await client.health(parsed.service);
        io.stdout.write(status + '\n');
        return status === 'SERVING' ? 0 : 3;
      }
      default:
        throw new Error(`unhandled command ${parsed.command}`);
    }
  } catch (err) {
    if (interrupted) {
      // the call was cancelled (the server stops its work) and what it wrote removed
      io.stderr.write(`error: CANCELLED: interrupted by ${interrupted}\n`);
      return 130;
    }
    if (err instanceof GraphoptError) {
      io.stderr.write(`error: ${err.codeName}: ${err.details}\n`);
      const least = err.metadata && err.metadata.get('graphopt-least-feasible-peak-bytes')[0];
      if (least !== undefined) {
        io.stderr.write(`the least feasible peak is ${least} bytes (${human(least)}): give --budget ${least} or more\n`);
      }
      return 2;
    }
    io.stderr.write(`error: ${err && err.message ? err.message : String(err)}\n`);
    return 1;
  } finally {
    if (client) client.close();
    if (io.handleSignals) {
      process.removeListener('SIGINT', onSignal);
      process.removeListener('SIGTERM', onSignal);
    }
  }
}

module.exports = { run, parseCommandLine, parseBytes, parseInputDims, progressLine, human, UsageError, optionFlags };

if (require.main === module) {
  // grpc-js sets the TLS server name to the target's host even when that is an IP address
  // (--server 127.0.0.1:P with --tls-ca), and Node warns about it (DEP0123) on every call;
  // the certificate is still checked against the IP. Drop that one warning, keep the rest.
  const emitWarning = process.emitWarning;
  process.emitWarning = function filtered(warning, ...rest) {
    const code = rest[0] && typeof rest[0] === 'object' ? rest[0].code : rest[1];
    if (code === 'DEP0123') return;
    emitWarning.call(process, warning, ...rest);
  };
  // `graphopt-node strategies ... | head`: a closed stdout is not an error
  process.stdout.on('error', (err) => {
    if (err.code === 'EPIPE') process.exit(process.exitCode || 0);
    throw err;
  });
  run(process.argv.slice(2), { stdout: process.stdout, stderr: process.stderr, handleSignals: true }).then((code) => {
    process.exitCode = code;
  }, (err) => {
    process.stderr.write(`error: ${err && err.stack ? err.stack : err}\n`);
    process.exitCode = 1;
  });
}
