#!/usr/bin/env node
// A Meridian client written in Node, to show (and test) that the meridian.v1 contracts are
// usable from outside Python: it loads the .proto files directly with @grpc/proto-loader
// (no generated code), runs one RL episode group through rollout's RunEpisodes and reads
// weightsync's Status, then prints one JSON object on stdout.
//
//   node client.js --rollout HOST:PORT --weightsync HOST:PORT [--task ID] [--group-size N]
//                  [--max-tokens N] [--timeout-s S]
//                  [--credentials DIR --role ROLE | --insecure] [--check-refusals]
//
// Authentication follows the stack's contract: TLS trusting the deployment's CA (ca.pem)
// with the client certificate (client.pem, client-key.pem) for mTLS, and the metadata
// "authorization: Bearer <token>" with the role's token from tokens.json, all from the
// credentials folder (--credentials, or MERIDIAN_CREDENTIALS; --role or MERIDIAN_ROLE,
// default operator: RunEpisodes is the operator's). --insecure: plaintext without a token
// (a stack started with --insecure on loopback). --check-refusals also calls each service
// with no token and with an unknown one, and reports the status codes it got.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILES = ['meridian/v1/rollout.proto', 'meridian/v1/weightsync.proto'];

const DEFAULTS = {
  task: 'text/shout',
  'group-size': '2',
  'max-tokens': '16',
  'timeout-s': '300',
  credentials: process.env.MERIDIAN_CREDENTIALS || '',
  role: process.env.MERIDIAN_ROLE || 'operator',
};
const FLAGS = new Set(['insecure', 'check-refusals']);

function parseArgs(argv) {
  const args = { ...DEFAULTS };
  for (let i = 0; i < argv.length; i++) {
    const name = argv[i].replace(/^--/, '');
    if (!argv[i].startsWith('--')) throw new Error(`unexpected argument ${argv[i]}`);
    if (FLAGS.has(name)) {
      args[name] = true;
    } else if (i + 1 < argv.length) {
      args[name] = argv[++i];
    } else {
      throw new Error(`--${name} needs a value`);
    }
  }
  for (const required of ['rollout', 'weightsync']) {
    if (!args[required]) throw new Error(`--${required} HOST:PORT is required`);
  }
  if (!args.insecure && !args.credentials) {
    throw new Error('no credentials: pass --credentials DIR (or set MERIDIAN_CREDENTIALS), or --insecure for a plaintext loopback stack');
  }
  return args;
}

function loadApi() {
  // keepCase: the field names of the .proto files; int64 as decimal strings (no precision
  // loss); enums by name; defaults so unset scalars read as their proto3 zero values.
  const definition = protoLoader.loadSync(PROTO_FILES, {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).meridian.v1;
}

function readCredentials(folder, role) {
  const read = (name) => fs.readFileSync(path.join(folder, name));
  const tokens = JSON.parse(read('tokens.json'));
  if (!tokens[role]) throw new Error(`${folder}/tokens.json has no token for role ${role}`);
  return {
    channel: grpc.credentials.createSsl(read('ca.pem'), read('client-key.pem'), read('client.pem')),
    token: tokens[role],
  };
}

function metadataWith(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

function unary(client, method, request, metadata, timeoutS) {
  const deadline = new Date(Date.now() + timeoutS * 1000);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) || String(code);
}

// What one call without a valid token got: the code's name and the server's message.
async function refusal(client, method, request, metadata) {
  try {
    await unary(client, method, request, metadata, 30);
    return { code: 'OK', details: '' };
  } catch (err) {
    return { code: statusName(err.code), details: err.details || '' };
  }
}

function summarise(trajectory) {
  return {
    trajectory_id: trajectory.trajectory_id,
    task_id: trajectory.task_id,
    group_id: trajectory.group_id,
    group_size: trajectory.group_size,
    reward: trajectory.reward,
    finish_reason: trajectory.finish_reason,
    prompt_tokens: trajectory.prompt_token_ids.length,
    completion_tokens: trajectory.completion_token_ids.length,
    logprobs: trajectory.logprobs.length,
    loss_mask: trajectory.loss_mask.length,
    policy_versions: trajectory.policy_versions,
    model: trajectory.model,
  };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const api = loadApi();
  const auth = args.insecure ? { channel: grpc.credentials.createInsecure(), token: '' } : readCredentials(args.credentials, args.role);
  const rollout = new api.Rollout(args.rollout, auth.channel);
  const weightsync = new api.WeightSync(args.weightsync, auth.channel);
  const timeoutS = Number(args['timeout-s']);
  try {
    const request = {
      task_ids: [args.task],
      group_size: Number(args['group-size']),
      sampling: { max_tokens: Number(args['max-tokens']) },
      publish: false, // an API client's look at the policy; nothing goes to the trainer
    };
    const started = Date.now();
    const episodes = await unary(rollout, 'RunEpisodes', request, metadataWith(auth.token), timeoutS);
    const episodeSeconds = (Date.now() - started) / 1000;
    const status = await unary(weightsync, 'Status', {}, metadataWith(auth.token), 30);
    const out = {
      secure: !args.insecure,
      role: args.insecure ? null : args.role,
      episode_seconds: episodeSeconds,
      trajectories: episodes.trajectories.map(summarise),
      weightsync_status: status,
    };
    if (args['check-refusals']) {
      const noToken = new grpc.Metadata();
      const unknown = metadataWith('not-a-meridian-token');
      out.refusals = {
        rollout_run_episodes_without_token: await refusal(rollout, 'RunEpisodes', request, noToken),
        weightsync_status_without_token: await refusal(weightsync, 'Status', {}, noToken),
        weightsync_status_unknown_token: await refusal(weightsync, 'Status', {}, unknown),
      };
    }
    process.stdout.write(JSON.stringify(out) + '\n');
  } finally {
    rollout.close();
    weightsync.close();
  }
}

main().catch((err) => {
  // A gRPC error carries its status; anything else (bad flags, unreadable files) is a plain error.
  const error = err.code !== undefined ? { code: statusName(err.code), details: err.details } : { message: String(err.message || err) };
  process.stdout.write(JSON.stringify({ error }) + '\n');
  process.exit(1);
});
