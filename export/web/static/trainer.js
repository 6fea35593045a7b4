// A client's local training in LiteRT.js, as export/device_training.py does it in LiteRT
// Python: set_weights (the server's model; it zeroes the momentum buffers), then one `train`
// step per batch of `batchSize` examples of `order`, the last batch possibly smaller, then
// get_weights. The file is one of `convert_trainable(static_batch=B)` (LiteRT.js runs only
// declared shapes): a batch is padded to B with copies of its first example and masked.

import {loadAndCompile} from "./litert/core.js";
import {firstLine, Problem, runSignature} from "./tffens.js";

const SIGNATURES = ["train", "infer", "get_weights", "set_weights"];
const product = (shape) => shape.reduce((a, b) => a * b, 1);

export class Trainer {
  static async open(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Problem(`the trainable file could not be fetched (HTTP ${response.status}): is the run still going?`);
    const bytes = new Uint8Array(await response.arrayBuffer());
    try {
      return new Trainer(await loadAndCompile(bytes, {accelerator: "wasm"}));
    } catch (e) {
      throw e instanceof Problem ? e : new Problem(`LiteRT.js cannot load the trainable file (${firstLine(e)})`);
    }
  }

  constructor(compiled) {
    const signatures = compiled.signatures;
    const missing = SIGNATURES.filter((name) => !signatures[name]);
    if (missing.length) throw new Problem(`the file has no ${missing.join(", ")} signature(s): write it with convert_trainable`);
    this.compiled = compiled;
    this.signatures = signatures;
    const inputs = Object.fromEntries(signatures.train.getInputDetails().map((d) => [d.name, d]));
    if (!inputs.mask) throw new Problem("the file's train signature has no mask: write it with convert_trainable(static_batch=B)");
    this.xShape = Array.from(inputs.x.shape);
    this.batch = this.xShape[0];
    this.inputSize = product(this.xShape.slice(1));
    const weights = signatures.set_weights.getInputDetails();
    this.weightShapes = weights.map((_, i) => Array.from(weights.find((d) => d.name === `w${i}`).shape));
    this.numWeights = this.weightShapes.reduce((n, shape) => n + product(shape), 0);
  }

  run(name, named) {
    return runSignature(this.signatures[name], named);
  }

  // `flat`: every weight, in order w0, w1, ..., concatenated.
  async setWeights(flat) {
    if (flat.length !== this.numWeights) throw new Problem(`the server sent ${flat.length} weights, the file has ${this.numWeights}`);
    const named = {};
    let offset = 0;
    this.weightShapes.forEach((shape, i) => {
      named[`w${i}`] = [flat.slice(offset, offset + product(shape)), shape];
      offset += product(shape);
    });
    await this.run("set_weights", named);
  }

  async getWeights() {
    const outputs = await this.run("get_weights", {});
    const flat = new Float32Array(this.numWeights);
    let offset = 0;
    this.weightShapes.forEach((shape, i) => {
      flat.set(outputs[`w${i}`], offset);
      offset += product(shape);
    });
    return flat;
  }

  // One step on the examples `indices` of x, y: {loss, correct}, taken before the step.
  async step(x, y, indices) {
    const size = this.inputSize;
    const bx = new Float32Array(this.batch * size), by = new Int32Array(this.batch), mask = new Float32Array(this.batch);
    for (let i = 0; i < this.batch; i++) {
      const k = indices[i < indices.length ? i : 0];
      bx.set(x.subarray(k * size, (k + 1) * size), i * size);
      by[i] = y[k];
      mask[i] = i < indices.length ? 1 : 0;
    }
    const out = await this.run("train", {x: [bx, this.xShape], y: [by, [this.batch]], mask: [mask, [this.batch]]});
    return {loss: out.loss[0], correct: out.correct[0]};
  }

  // A task's local epochs: {weights, losses, correct} (per step), calling onStep(n, steps, loss).
  async train({weights, x, y, order, batchSize}, onStep) {
    if (!(batchSize >= 1 && batchSize <= this.batch)) throw new Problem(`batch size ${batchSize} is not in 1..${this.batch}, the file's batch`);
    await this.setWeights(weights);
    const steps = Math.ceil(order.length / batchSize);
    const losses = new Float32Array(steps), correct = new Float32Array(steps);
    for (let s = 0; s < steps; s++) {
      const result = await this.step(x, y, order.subarray(s * batchSize, (s + 1) * batchSize));
      losses[s] = result.loss;
      correct[s] = result.correct;
      onStep(s + 1, steps, result.loss);
    }
    return {weights: await this.getWeights(), losses, correct};
  }
}
