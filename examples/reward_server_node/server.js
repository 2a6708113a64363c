#!/usr/bin/env node
// A verst.v1.Reward server in Node.js: graded numeric closeness with a relative tolerance.
//
// Anything that serves verst.v1.Reward (proto/verst/v1/reward.proto) can score a job's samples:
// point the JobSpec's reward.address at it and name one of its verifiers in reward.verifier.
// This server loads the repository's proto files at run time (@grpc/proto-loader, no generated
// code) and serves Reward and the standard gRPC health service, which verst's api probes when
// a job is submitted.
//
// Its one verifier, `closeness` (also the default for an empty name), reads the last number of
// the response and of the reference answer (`-12`, `3.5`, `1,234.5`, `.5`, `6.02e23`, `3/4`) and
// measures the error relative to the answer, or to 1 when the answer is smaller than 1:
//
//   relative_error = |got - want| / max(|want|, 1)
//   reward         = 1                          if relative_error <= rtol
//                    max(0, 1 - relative_error) otherwise
//
// verst's own `numeric` verifier gives 1 or 0; this one gives an answer 5% off 0.95. Components:
// `parsed` (the response has a number), `within_tolerance`, and `relative_error` when parsed.
// An item whose answer has no number, or that names a verifier this server does not know,
// gets `error` set; the other items of its batch are scored as usual.
//
//   node examples/reward_server_node/server.js --port 50061 [--host 0.0.0.0] [--rtol 0.01]

"use strict";

const path = require("node:path");
const { parseArgs } = require("node:util");

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { HealthImplementation } = require("grpc-health-check");

const SERVICE_NAME = "verst.v1.Reward";
const DEFAULT_VERIFIER = "closeness";
const DEFAULT_PORT = 50061;
const DEFAULT_RTOL = 0.01;
const MAX_MESSAGE_BYTES = 256 * 1024 * 1024; // verst's clients send batches of long trajectories
const SHUTDOWN_GRACE_MS = 5000; // how long calls in flight may take to finish after SIGTERM
const PROTO_DIR = path.resolve(__dirname, "..", "..", "proto"); // the repository's proto/ folder

// A number as answers write it; the same syntax as verst's `numeric` verifier.
const NUMBER = new RegExp(
  String.raw`(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?!\.?\d))?` +
    String.raw`|(?<![\w.])[-+]?\.\d+(?:[eE][-+]?\d+)?`,
  "g",
);

/** The value and text of the last number in `text`, or null when it has none (or it is not finite). */
function lastNumber(text) {
  const matches = text.match(NUMBER);
  if (!matches) return null;
  const shown = matches[matches.length - 1];
  const [numerator, denominator] = shown.replace(/,/g, "").replace(/\s/g, "").split("/");
  const value = denominator === undefined ? Number(numerator) : Number(numerator) / Number(denominator);
  return Number.isFinite(value) ? { value, shown } : null;
}

/** Verifiers by the name a ScoreRequest's `verifier` carries: (request, options) -> result. */
const VERIFIERS = {
  closeness(request, options) {
    const want = lastNumber(request.answer);
    if (want === null) {
      throw new Error(`the answer ${JSON.stringify(request.answer.slice(0, 100))} has no number`);
    }
    const got = lastNumber(request.response_text);
    const info = { scorer: "closeness", rtol: String(options.rtol) };
    if (got === null) {
      return { reward: 0, components: { parsed: 0, within_tolerance: 0 }, info: { ...info, parsed: "" } };
    }
    const relativeError = Math.abs(got.value - want.value) / Math.max(Math.abs(want.value), 1);
    const within = relativeError <= options.rtol;
    return {
      reward: within ? 1 : Math.max(0, 1 - relativeError),
      components: { parsed: 1, within_tolerance: within ? 1 : 0, relative_error: relativeError },
      info: { ...info, parsed: got.shown },
    };
  },
};

/** One ScoreResponse; every failure becomes `error` on the item, never a failed call. */
function score(request, options) {
  const name = request.verifier || DEFAULT_VERIFIER;
  const verify = Object.hasOwn(VERIFIERS, name) ? VERIFIERS[name] : null;
  if (verify === null) {
    return { reward: 0, components: {}, info: {}, error: unknownVerifier(name) };
  }
  try {
    return { error: "", ...verify(request, options) };
  } catch (err) {
    const error = `verifier ${JSON.stringify(name)}: ${err.message}`;
    return { reward: 0, components: {}, info: {}, error };
  }
}

function unknownVerifier(name) {
  const known = Object.keys(VERIFIERS).sort().join(", ");
  return `unknown verifier ${JSON.stringify(name)}; this server knows: ${known}`;
}

/** The Reward service's handlers. */
function rewardHandlers(options) {
  return {
    Score(call, callback) {
      callback(null, score(call.request, options));
    },
    ScoreBatch(call, callback) {
      callback(null, { results: call.request.items.map((item) => score(item, options)) });
    },
    CheckVerifier(call, callback) {
      const name = call.request.verifier || DEFAULT_VERIFIER;
      const ok = Object.hasOwn(VERIFIERS, name);
      const verifiers = Object.keys(VERIFIERS).sort();
      callback(null, { ok, error: ok ? "" : unknownVerifier(name), verifiers });
    },
  };
}

function loadRewardService(protoDir) {
  const definition = protoLoader.loadSync("verst/v1/reward.proto", {
    includeDirs: [protoDir],
    keepCase: true, // field names as the proto writes them: response_text, prompt_token_ids
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).verst.v1.Reward.service;
}

function log(level, message) {
  process.stdout.write(`${new Date().toISOString()} reward_server_node ${level} ${message}\n`);
}

function usage(problem) {
  process.stderr.write(
    `reward_server_node: ${problem}\n` +
      "usage: node server.js [--host HOST] [--port PORT] [--rtol RTOL] [--proto-dir DIR]\n" +
      `  --host       address to listen on (default 0.0.0.0)\n` +
      `  --port       port to listen on, 0 picks a free one (default ${DEFAULT_PORT})\n` +
      `  --rtol       relative error that still earns full credit (default ${DEFAULT_RTOL})\n` +
      `  --proto-dir  the folder holding verst/v1/reward.proto (default ${PROTO_DIR})\n`,
  );
  process.exit(2);
}

function parseOptions(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        host: { type: "string", default: "0.0.0.0" },
        port: { type: "string", default: String(DEFAULT_PORT) },
        rtol: { type: "string", default: String(DEFAULT_RTOL) },
        "proto-dir": { type: "string", default: PROTO_DIR },
      },
    }));
  } catch (err) {
    usage(err.message);
  }
  const port = Number(values.port);
  if (!/^\d+$/.test(values.port) || port > 65535) {
    usage(`--port must be an integer in [0, 65535], got ${values.port}`);
  }
  const rtol = Number(values.rtol);
  if (values.rtol.trim() === "" || !Number.isFinite(rtol) || rtol < 0) {
    usage(`--rtol must be a number >= 0, got ${values.rtol}`);
  }
  return { host: values.host, port, rtol, protoDir: values["proto-dir"] };
}

function main() {
  const options = parseOptions(process.argv.slice(2));
  const server = new grpc.Server({
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  });
  server.addService(loadRewardService(options.protoDir), rewardHandlers(options));
  const health = new HealthImplementation({ "": "NOT_SERVING", [SERVICE_NAME]: "NOT_SERVING" });
  health.addToServer(server);

  const host = options.host.includes(":") ? `[${options.host}]` : options.host; // an IPv6 address
  const address = `${host}:${options.port}`;
  server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      log("ERROR", `cannot listen on ${address}: ${err.message}`);
      process.exit(1);
    }
    health.setStatus("", "SERVING");
    health.setStatus(SERVICE_NAME, "SERVING");
    log("INFO", `serving ${SERVICE_NAME} (closeness, rtol=${options.rtol}) on ${options.host}:${port}`);
  });

  let stopping = false;
  const stop = (signal) => {
    if (stopping) return;
    stopping = true;
    log("INFO", `${signal}: stopping (calls in flight have ${SHUTDOWN_GRACE_MS / 1000}s)`);
    health.setStatus("", "NOT_SERVING");
    health.setStatus(SERVICE_NAME, "NOT_SERVING");
    const grace = setTimeout(() => {
      log("WARNING", "calls still in flight after the grace period; cancelling them");
      server.forceShutdown();
    }, SHUTDOWN_GRACE_MS);
    server.tryShutdown(() => {
      clearTimeout(grace);
      log("INFO", "stopped");
      process.exitCode = 0;
    });
  };
  process.on("SIGTERM", () => stop("SIGTERM"));
  process.on("SIGINT", () => stop("SIGINT"));
}

module.exports = { lastNumber, score, VERIFIERS, DEFAULT_VERIFIER };

if (require.main === module) {
  main();
}
