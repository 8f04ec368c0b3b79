#!/usr/bin/env node
// Throughput of Hugging Face's Rust `tokenizers` (0.22.x, through the @anush008/tokenizers Node
// binding) on a JSONL of {"text": ...} documents: the number strata's C++ tokenizer is compared to.
//
//   NODE_PATH=/path/to/node_modules node bench/text/rust_tokenizers.js TOKENIZER INPUT [options]
//     TOKENIZER  tokenizer.json, tokenizer.json.gz, or a fixture name (tests/text/fixtures/tokenizers/
//                <name>/, derived ones included)
//     INPUT      .jsonl or .jsonl.gz, one {"text": ...} per line
//                (python3 tests/text/fixtures/make_corpus.py --bench-mb 20 --out /tmp/bench20.jsonl)
//   --mode batch1   (default) encodeBatch in chunks with TOKENIZERS_PARALLELISM=false: the Rust
//                   side runs every document on one thread, one N-API call per chunk
//   --mode seq      await encode(doc) for one document after another (one thread too, but one N-API
//                   call and one thread-pool hop per document)
//   --mode rayon1   encodeBatch in chunks on a rayon pool of one thread (RAYON_NUM_THREADS=1)
//   --mode multi    encodeBatch in chunks on rayon's default pool (all cores): the multi-thread number
//   --chunk N       documents per encodeBatch call (default 256)
//   --repeat N      timed passes (default 3); the fastest is reported
//
// Prints one JSON line: {"impl":"hf-tokenizers-rust","tokenizer":...,"mode":...,"threads":...,
// "docs":N,"bytes":B,"tokens":T,"seconds":S,"mb_per_s":B/S/1e6,...}: S is the fastest pass's wall
// time; "runs" all passes; "cpu_seconds" the process CPU time (all threads) of that pass and "load1"
// the 1-minute load average at the end, to tell a contended machine from a slow tokenizer. File reading, gunzip and
// JSON parsing are outside the timed part; one untimed warm-up pass over the first ~2 MB comes first.
// What is timed is the encode call (addSpecialTokens false) until its Encodings exist; the binding
// always computes char offsets as well (encode_char_offsets). Token ids are not copied into JS
// arrays inside the timed part (getLength() is used for the count).
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");
const zlib = require("zlib");

function usage(msg) {
  if (msg) console.error(msg);
  console.error("usage: node rust_tokenizers.js TOKENIZER INPUT [--mode batch1|seq|rayon1|multi] [--chunk N] [--repeat N]");
  process.exit(2);
}

const argv = process.argv.slice(2);
const pos = [];
const opt = { mode: "batch1", chunk: 256, repeat: 3 };
for (let i = 0; i < argv.length; i++) {
  const a = argv[i];
  if (a === "--mode") opt.mode = argv[++i];
  else if (a === "--chunk") opt.chunk = parseInt(argv[++i], 10);
  else if (a === "--repeat") opt.repeat = parseInt(argv[++i], 10);
  else if (a === "-h" || a === "--help") usage();
  else if (a.startsWith("--")) usage(`unknown option ${a}`);
  else pos.push(a);
}
if (pos.length !== 2) usage();
if (!["batch1", "seq", "rayon1", "multi"].includes(opt.mode)) usage(`bad --mode ${opt.mode}`);

// Thread settings must be in the environment before the native module first uses rayon (its global
// pool is built lazily on first use and reads RAYON_NUM_THREADS then; tokenizers reads
// TOKENIZERS_PARALLELISM on every batch). Node's process.env writes go to the real environment.
if (opt.mode === "batch1" || opt.mode === "seq") {
  process.env.TOKENIZERS_PARALLELISM = "false";
  process.env.RAYON_NUM_THREADS = "1";
} else if (opt.mode === "rayon1") {
  process.env.TOKENIZERS_PARALLELISM = "true";
  process.env.RAYON_NUM_THREADS = "1";
} else {
  process.env.TOKENIZERS_PARALLELISM = "true";
  delete process.env.RAYON_NUM_THREADS;
}
const { Tokenizer } = require("@anush008/tokenizers");

const FIXTURES = path.join(__dirname, "..", "..", "tests", "text", "fixtures", "tokenizers");
function readMaybeGz(p) {
  const b = fs.readFileSync(p);
  return (p.endsWith(".gz") ? zlib.gunzipSync(b) : b).toString("utf8");
}
// tokenizer.json text for a path or a fixture name (derive.json: base + "set", keys may be a.b paths)
function tokenizerJson(spec) {
  if (fs.existsSync(spec) && fs.statSync(spec).isFile()) return JSON.parse(readMaybeGz(spec));
  const dir = path.join(FIXTURES, spec);
  if (fs.existsSync(path.join(dir, "tokenizer.json.gz"))) return JSON.parse(readMaybeGz(path.join(dir, "tokenizer.json.gz")));
  if (!fs.existsSync(path.join(dir, "derive.json"))) usage(`no tokenizer ${spec}`);
  const d = JSON.parse(fs.readFileSync(path.join(dir, "derive.json"), "utf8"));
  const obj = tokenizerJson(d.from);
  for (const [key, value] of Object.entries(d.set)) {
    const parts = key.split(".");
    let o = obj;
    for (const p of parts.slice(0, -1)) o = o[p];
    o[parts[parts.length - 1]] = value;
  }
  return obj;
}

async function encodeAll(tok, docs, mode, chunk) {
  let tokens = 0;
  if (mode === "seq") {
    for (const d of docs) tokens += (await tok.encode(d, null, { addSpecialTokens: false })).getLength();
  } else {
    for (let i = 0; i < docs.length; i += chunk) {
      const encs = await tok.encodeBatch(docs.slice(i, i + chunk), { addSpecialTokens: false });
      for (const e of encs) tokens += e.getLength();
    }
  }
  return tokens;
}

async function main() {
  const [tokSpec, input] = pos;
  const tok = Tokenizer.fromString(JSON.stringify(tokenizerJson(tokSpec)));
  const docs = readMaybeGz(input).split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l).text);
  let bytes = 0;
  for (const d of docs) bytes += Buffer.byteLength(d, "utf8");

  // warm-up: the first ~2 MB, untimed
  const warm = [];
  for (let i = 0, b = 0; i < docs.length && b < 2e6; i++) { warm.push(docs[i]); b += docs[i].length; }
  await encodeAll(tok, warm, opt.mode, opt.chunk);

  let best = Infinity, bestCpu = 0, tokens = 0;
  const all = [];
  for (let r = 0; r < opt.repeat; r++) {
    const c0 = process.cpuUsage();
    const t0 = process.hrtime.bigint();
    tokens = await encodeAll(tok, docs, opt.mode, opt.chunk);
    const s = Number(process.hrtime.bigint() - t0) / 1e9;
    const c = process.cpuUsage(c0);
    all.push(+s.toFixed(3));
    if (s < best) { best = s; bestCpu = (c.user + c.system) / 1e6; }
  }
  const threads = opt.mode === "multi" ? os.cpus().length : 1;
  console.log(JSON.stringify({
    impl: "hf-tokenizers-rust", tokenizer: tokSpec, mode: opt.mode, threads, docs: docs.length, bytes, tokens,
    seconds: +best.toFixed(3), mb_per_s: +(bytes / best / 1e6).toFixed(2), runs: all,
    cpu_seconds: +bestCpu.toFixed(3), load1: +os.loadavg()[0].toFixed(2),
    tokenizers_crate: "0.22 (@anush008/tokenizers 0.6.0)", node: process.version,
  }));
}

main().catch((e) => { console.error(e); process.exit(1); });
