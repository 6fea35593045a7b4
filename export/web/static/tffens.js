// A tff-ens .tflite file in LiteRT.js (WASM): an ensemble's `predict` and `personalize`
// signatures, or a single model's logits, on fixed batches (the files of `python -m export
// --static_batch=N`; a single model's float or dynamic file has a batch of 1). The math
// outside the file is `export.on_device`'s: inputs padded to the batch with copies of the
// first, personalization in chunks at temperature 1 whose size-weighted mean log alpha,
// divided by the temperature, is softmaxed in float64.

import {loadAndCompile, loadLiteRt, Tensor} from "./litert/core.js";

// A one-line message for the page: what cannot run, why, and what to do.
export class Problem extends Error {}

// LiteRT's C++ log reaches the page through Emscripten's printErr, INFO lines included:
// each goes to the console at its own level. Its errors are kept: a file whose ops LiteRT.js
// lacks still compiles and runs, and says so only there.
const liteRtErrors = [];
function routeLiteRtLog(line) {
  if (/^(INFO|VERBOSE|DEBUG)\b/.test(line)) console.debug(line);
  else if (/^WARNING\b/.test(line)) console.warn(line);
  else {
    if (/^ERROR\b/.test(line)) liteRtErrors.push(line.replace(/^ERROR:\s*/, "").trim());
    console.error(line);
  }
}

let runtime = null;
export function loadRuntime(wasmDirectory) {
  if (!runtime) {
    self.Module = {print: (line) => console.debug(line), printErr: routeLiteRtLog};
    runtime = loadLiteRt(wasmDirectory);
  }
  return runtime;
}

const product = (shape) => shape.reduce((a, b) => a * b, 1);

function softmaxRows(logits, rows, classes) {
  const out = new Float64Array(rows * classes);
  for (let r = 0; r < rows; r++) {
    let max = -Infinity;
    for (let c = 0; c < classes; c++) max = Math.max(max, logits[r * classes + c]);
    let sum = 0;
    for (let c = 0; c < classes; c++) sum += out[r * classes + c] = Math.exp(logits[r * classes + c] - max);
    for (let c = 0; c < classes; c++) out[r * classes + c] /= sum;
  }
  return out;
}

// Entropy in nats with p clipped to [1e-12, 1] before the log (`ensemble_math.entropy`).
function entropyOf(p) {
  let h = 0;
  for (const q of p) h -= q * Math.log(Math.min(Math.max(q, 1e-12), 1));
  return h;
}

// The numbers of nested arrays and typed arrays, in order.
function flattened(x, out = []) {
  if (ArrayBuffer.isView(x)) {
    for (const v of x) out.push(v);
  } else if (Array.isArray(x)) {
    for (const item of x) flattened(item, out);
  } else {
    out.push(x);
  }
  return out;
}

function rows(flat, count, width) {
  return Array.from({length: count}, (_, i) => Array.from(flat.subarray(i * width, (i + 1) * width)));
}

export class TffEnsModel {
  // `info` is the file's tff-ens metadata (config.json), `name` its file name.
  static async open(url, info, name) {
    const response = await fetch(url);
    if (!response.ok) throw new Problem(`${name} could not be fetched (HTTP ${response.status}): restart python -m export.web`);
    const bytes = new Uint8Array(await response.arrayBuffer());
    const errorsBefore = liteRtErrors.length;
    let compiled;
    try {
      compiled = await loadAndCompile(bytes, {accelerator: "wasm"});
    } catch (e) {
      throw new Problem(`LiteRT.js cannot load ${name} (${firstLine(e)}): is it a complete .tflite file? Export it again with python -m export --static_batch=1`);
    }
    const model = new TffEnsModel(compiled, info, name);
    // A first prediction: a file can compile and still fail in its first run (an unresolved
    // custom op), and the first call is the slow one.
    const blank = new (model.takesIds ? Int32Array : Float32Array)(model.inputSize).fill(info.input.value_range[1]);
    let failure = null;
    try {
      await model.predict(blank);
    } catch (e) {
      failure = firstLine(e);
    }
    failure = failure || liteRtErrors[errorsBefore];
    if (failure) {
      throw new Problem(`LiteRT.js cannot run ${name} (${failure}): export the run with python -m export --static_batch=1 (binarized runs: --format=binary)`);
    }
    return model;
  }

  constructor(compiled, info, name) {
    this.compiled = compiled;
    this.info = info;
    this.name = name;
    this.isEnsemble = info.format === "ensemble";
    this.classes = info.class_labels.length;
    this.inputShape = info.input.shape.slice(1);
    this.inputSize = product(this.inputShape);
    this.takesIds = !info.input.dtype.startsWith("float") && info.input.dtype !== "int8";
    this.queue = Promise.resolve();
    if (this.isEnsemble) {
      const predict = compiled.signatures.predict, personalize = compiled.signatures.personalize;
      if (!predict || !personalize) throw new Problem(`${name} says it is an ensemble but has no predict and personalize signatures: export it again`);
      this.predictRunner = predict;
      this.personalizeRunner = personalize;
      this.ensembleSize = info.ensemble_size;
      this.batch = this.checkedBatch(predict);
      this.checkedBatch(personalize);
      this.predictInput = this.details(predict).find((d) => d.name !== "alpha").name;
      this.personalizeInput = this.details(personalize).find((d) => !["labels", "temperature", "mask"].includes(d.name)).name;
      this.masked = this.details(personalize).some((d) => d.name === "mask");
    } else {
      this.runner = compiled;
      this.batch = this.checkedBatch(compiled);
      this.ensembleSize = 1;
    }
  }

  details(runner) {
    try {
      return runner.getInputDetails();
    } catch (e) {
      throw new Problem(`${this.name} has tensors LiteRT.js cannot feed (${firstLine(e)}; it has float32, int32 and uint8): export it with python -m export --static_batch=1, whose int8 files take float32`);
    }
  }

  // The signature's fixed batch; a Problem if any input declares an unknown dimension.
  checkedBatch(runner) {
    const details = this.details(runner);
    const dynamic = details.find((d) => Array.from(d.shape).some((n) => n < 0));
    if (dynamic) {
      throw new Problem(`${this.name} declares a dynamic batch (${dynamic.name} [${Array.from(dynamic.shape)}]) and LiteRT.js runs only fixed shapes: export it with python -m export --static_batch=1`);
    }
    const input = details.find((d) => d.shape.length === this.inputShape.length + 1);
    return input.shape[0];
  }

  // Runs `work` after the calls before it: one signature call at a time.
  serialized(work) {
    const result = this.queue.then(work);
    this.queue = result.catch(() => {});
    return result;
  }

  // Inputs [n][...] (nested arrays or one flat array of n * inputSize) as a flat typed array.
  flatInputs(inputs, what) {
    const Typed = this.takesIds ? Int32Array : Float32Array;
    const flat = Typed.from(flattened(inputs));
    const n = flat.length / this.inputSize;
    if (!Number.isInteger(n) || n < 1) {
      throw new Problem(`${what} must be n >= 1 inputs of [${this.inputShape}] values, got ${flat.length} values`);
    }
    const [low, high] = this.info.input.value_range;
    for (const v of flat) {
      if (!(v >= low && v <= high)) throw new Problem(`${what} values must be in [${low}, ${high}] (${this.info.input.preprocessing}), got ${v}`);
    }
    return {flat, n};
  }

  // The chunk [start, start + count) of `flat` padded to the batch with copies of its first input.
  padded(flat, start, count, width) {
    const out = new flat.constructor(this.batch * width);
    out.set(flat.subarray(start * width, (start + count) * width));
    for (let i = count; i < this.batch; i++) out.copyWithin(i * width, 0, width);
    return out;
  }

  run(runner, named) {
    return runSignature(runner, named);
  }

  // {probabilities [n][classes], member_probabilities [n][K][classes], entropy [n],
  // mutual_information [n] (null for one model)} at `alpha` (K weights; default 1/K).
  predict(inputs, alpha) {
    return this.serialized(async () => {
      const {flat, n} = this.flatInputs(inputs, this.isEnsemble ? this.predictInput : "inputs");
      const out = {probabilities: [], member_probabilities: [], entropy: [], mutual_information: []};
      const shape = [this.batch, ...this.inputShape];
      const weights = this.checkedAlpha(alpha);
      for (let start = 0; start < n; start += this.batch) {
        const count = Math.min(this.batch, n - start);
        const chunk = this.padded(flat, start, count, this.inputSize);
        if (this.isEnsemble) {
          const o = await this.run(this.predictRunner, {[this.predictInput]: [chunk, shape], alpha: [weights, [this.ensembleSize]]});
          const k = this.ensembleSize, c = this.classes;
          out.probabilities.push(...rows(o.probabilities, count, c));
          for (let i = 0; i < count; i++) out.member_probabilities.push(rows(o.member_probabilities.subarray(i * k * c, (i + 1) * k * c), k, c));
          out.entropy.push(...o.entropy.subarray(0, count));
          out.mutual_information.push(...o.mutual_information.subarray(0, count));
        } else {
          const [logits] = Object.values(await this.run(this.runner, {[this.details(this.runner)[0].name]: [chunk, shape]}));
          const p = softmaxRows(logits, count, this.classes);
          for (const row of rows(p, count, this.classes)) {
            out.probabilities.push(row);
            out.member_probabilities.push([row]);
            out.entropy.push(entropyOf(row));
            out.mutual_information.push(null);
          }
        }
      }
      return out;
    });
  }

  checkedAlpha(alpha) {
    const k = this.ensembleSize;
    if (alpha == null) return new Float32Array(k).fill(1 / k);
    const a = Float32Array.from(alpha);
    const sum = a.reduce((s, v) => s + v, 0);
    if (a.length !== k || a.some((v) => !(v >= 0)) || Math.abs(sum - 1) > 1e-3) {
      throw new Problem(`alpha must be K=${k} non-negative weights summing to 1, got [${Array.from(a)}]`);
    }
    return a;
  }

  // alpha [K] = softmax(-loss / temperature) from the labeled inputs (Fed-ensemble eq. 4),
  // through the file's `personalize` signature; temperature Infinity gives 1/K.
  personalize(inputs, labels, temperature) {
    return this.serialized(async () => {
      if (!this.isEnsemble) throw new Problem(`${this.name} is one model: only an ensemble personalizes (export --format=ensemble)`);
      const {flat, n} = this.flatInputs(inputs, this.personalizeInput);
      const y = Int32Array.from(labels);
      if (y.length !== n || y.some((v, i) => v !== labels[i] || v < 0 || v >= this.classes)) {
        throw new Problem(`labels must be ${n} class indices in 0..${this.classes - 1}, one per input`);
      }
      if (!(temperature > 0)) throw new Problem(`temperature must be > 0 (Infinity: uniform), got ${temperature}`);
      const meanLogAlpha = new Float64Array(this.ensembleSize);
      const shape = [this.batch, ...this.inputShape];
      for (let start = 0; start < n; start += this.batch) {
        const count = Math.min(this.batch, n - start);
        const named = {
          [this.personalizeInput]: [this.padded(flat, start, count, this.inputSize), shape],
          labels: [this.padded(y, start, count, 1), [this.batch]],
          temperature: [Float32Array.of(1), []],
        };
        if (this.masked) named.mask = [Float32Array.from({length: this.batch}, (_, i) => (i < count ? 1 : 0)), [this.batch]];
        const {alpha} = await this.run(this.personalizeRunner, named);
        alpha.forEach((a, k) => (meanLogAlpha[k] += (count / n) * Math.log(a)));
      }
      const z = Array.from(meanLogAlpha, (v) => (temperature === Infinity ? 0 : v / temperature));
      const max = Math.max(...z);
      const e = z.map((v) => Math.exp(v - max));
      const sum = e.reduce((s, v) => s + v, 0);
      return e.map((v) => v / sum);
    });
  }
}

// The signature `runner` on named [data, shape] inputs; its outputs as typed arrays (copies),
// every tensor deleted after.
export async function runSignature(runner, named) {
  const inputs = Object.fromEntries(Object.entries(named).map(([k, [data, shape]]) => [k, new Tensor(data, shape)]));
  try {
    const outputs = await runner.run(inputs);
    const arrays = {};
    for (const [key, tensor] of Object.entries(outputs)) {
      arrays[key] = tensor.toTypedArray().slice();
      tensor.delete();
    }
    return arrays;
  } finally {
    for (const tensor of Object.values(inputs)) tensor.delete();
  }
}

export function firstLine(error) {
  return String((error && error.message) || error).split("\n")[0].slice(0, 200);
}
