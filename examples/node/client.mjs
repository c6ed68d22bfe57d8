#!/usr/bin/env node
// Submit one prompt to a kvroute router over ZMQ and print the streamed text.
//   node client.mjs "Once upon a time" [--endpoint tcp://127.0.0.1:5555] [--max-tokens 32]
// With --tool the prompt is a chat message and the model must call a get_weather tool; the call is printed.
//   node client.mjs --tool "What is the weather in Paris?"
// Written from protocol/PROTOCOL.md: one DEALER socket, one msgpack map per frame, `type` + `v` on
// every message, token ids as little-endian int32 bytes.
import { Dealer } from "zeromq";
import { encode, decode } from "@msgpack/msgpack";

const PROTOCOL_VERSION = 1;

function parseArgs(argv) {
  const opts = { endpoint: process.env.KVROUTE_ENDPOINT ?? "tcp://127.0.0.1:5555", maxTokens: 32, timeoutMs: 120000, tool: false };
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--endpoint") opts.endpoint = argv[++i];
    else if (argv[i] === "--max-tokens") opts.maxTokens = Number(argv[++i]);
    else if (argv[i] === "--timeout-ms") opts.timeoutMs = Number(argv[++i]);
    else if (argv[i] === "--tool") opts.tool = true;
    else rest.push(argv[i]);
  }
  opts.prompt = rest.join(" ") || "Once upon a time";
  return opts;
}

// Token ids travel as packed little-endian int32.
function unpackTokens(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = [];
  for (let i = 0; i + 4 <= bytes.byteLength; i += 4) out.push(view.getInt32(i, true));
  return out;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const sock = new Dealer({ receiveTimeout: opts.timeoutMs, linger: 0 });
  sock.connect(opts.endpoint);
  const id = `node-${process.pid}-${Date.now()}`;
  const submit = {
    type: "submit",
    v: PROTOCOL_VERSION,
    id,
    sampling: { max_tokens: opts.maxTokens, temperature: 0 },
    stream: true,
  };
  if (opts.tool) {
    // A chat with one function; tool_choice names it, so the router makes the model call it (with a grammar).
    submit.messages = [{ role: "user", content: opts.prompt }];
    submit.tools = [{
      name: "get_weather",
      description: "The weather forecast for a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string" }, days: { type: "integer", minimum: 1, maximum: 7 } },
        required: ["city"],
      },
    }];
    submit.tool_choice = { name: "get_weather" };
  } else {
    submit.prompt = opts.prompt;
  }
  await sock.send(encode(submit));
  let streamed = 0;
  const streamedCalls = [];
  try {
    for (;;) {
      const [frame] = await sock.receive();
      const msg = decode(frame);
      if (msg.id !== id && msg.id !== null) continue; // not ours
      if (msg.type === "delta") {
        streamed += unpackTokens(msg.tokens).length;
        process.stdout.write(msg.text);
        for (const piece of msg.tool_calls) { // a call's first piece has its id and name, the next ones more arguments
          if (piece.name != null) streamedCalls[piece.index] = { index: piece.index, id: piece.id, name: piece.name, arguments: "" };
          streamedCalls[piece.index].arguments += piece.arguments;
        }
      } else if (msg.type === "result") {
        const u = msg.usage;
        process.stdout.write("\n");
        console.error(JSON.stringify({
          finish_reason: msg.finish_reason, prompt_tokens: u.prompt_tokens, cached_tokens: u.cached_tokens,
          completion_tokens: u.completion_tokens, streamed_tokens: streamed, result_tokens: unpackTokens(msg.tokens).length,
          worker: msg.worker, slot: msg.slot, tool_calls: msg.tool_calls, streamed_tool_calls: streamedCalls,
        }));
        return 0;
      } else if (msg.type === "error") {
        console.error(`kvroute error ${msg.code}: ${msg.message}`);
        return 1;
      }
    }
  } catch (err) {
    if (err.code === "EAGAIN") console.error(`no reply from ${opts.endpoint} in ${opts.timeoutMs} ms`);
    else console.error(String(err));
    return 1;
  } finally {
    sock.close();
  }
}

process.exitCode = await main();
