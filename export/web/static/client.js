// The browser client of a run (export/web/client_server.py): it connects to the run's
// event stream, trains each task it is sent with `Trainer` and posts the result back.

import {firstLine, loadRuntime, Problem} from "./tffens.js";
import {Trainer} from "./trainer.js";

const $ = (id) => document.getElementById(id);

function show(status, problem = false) {
  $("status").textContent = status;
  $("status").classList.toggle("problem", problem);
}

async function fetched(url, Typed) {
  const response = await fetch(url);
  if (!response.ok) throw new Problem(`${url} could not be fetched (HTTP ${response.status})`);
  return new Typed(await response.arrayBuffer());
}

// The task's data, trained; the result posted as float32: weights, step losses, step correct.
async function runTask(trainer, task) {
  $("task").textContent = String(task.id);
  const base = `tasks/${task.id}/`;
  const [weights, x, y, order] = await Promise.all([
    fetched(base + "weights", Float32Array),
    fetched(base + "x", Float32Array),
    fetched(base + "y", Int32Array),
    fetched(base + "order", Int32Array),
  ]);
  show(`training task ${task.id}: ${task.num_examples} examples in batches of ${task.batch_size}`);
  const result = await trainer.train({weights, x, y, order, batchSize: task.batch_size}, (n, steps, loss) => {
    $("step").textContent = `${n}/${steps}`;
    $("loss").textContent = loss.toFixed(4);
  });
  const body = new Float32Array(result.weights.length + 2 * result.losses.length);
  body.set(result.weights);
  body.set(result.losses, result.weights.length);
  body.set(result.correct, result.weights.length + result.losses.length);
  // A Blob, not the typed array: Chromium uploads a 26 MB typed array 8x slower.
  const response = await fetch(base + "result", {method: "POST", body: new Blob([body]), headers: {"Content-Type": "application/octet-stream"}});
  if (!response.ok) throw new Problem(`the run refused task ${task.id}'s result (HTTP ${response.status})`);
  $("done").textContent = String(Number($("done").textContent) + 1);
  show("waiting for the next task");
}

async function main() {
  await loadRuntime("litert/wasm/");
  show("Loading the model…");
  const trainer = await Trainer.open("trainable.tflite");
  connect(trainer, new URLSearchParams(location.search).get("name") || "browser");
}

// The run's event stream. A task that fails closes it, which the run counts as a dropout;
// the page then joins again as a new client.
function connect(trainer, name) {
  const events = new EventSource(`events?name=${encodeURIComponent(name)}`);
  let work = Promise.resolve();
  events.addEventListener("hello", (e) => {
    $("name").textContent = JSON.parse(e.data).name;
    show("connected: waiting for a task");
  });
  events.addEventListener("task", (e) => {
    const task = JSON.parse(e.data);
    work = work.then(() => runTask(trainer, task)).catch((error) => {
      show(`${firstLine(error)}: joining again`, true);
      events.close();
      setTimeout(() => connect(trainer, name), 2000);
    });
  });
  events.addEventListener("error", () => show("disconnected from the run: reconnecting…", true));
}

main().catch((error) => show(firstLine(error), true));
