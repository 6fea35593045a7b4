// The page: one file of the run (config.json lists them; ?file=NAME picks one), in LiteRT.js.
// FEMNIST: draw, see the 28x28 input, top-5, the members' votes, entropy and mutual
// information, "not sure" above the file's threshold, and personalization kept in this
// browser's localStorage. Shakespeare: type, see the next character's top-5.
// window.tffEns: {ready, predict(inputs, alpha), personalize(inputs, labels, temperature),
// info, alpha, files; FEMNIST: show(image) classifies an image as a drawing, input() is
// the current 28x28 input}.

import {Pad, showImage} from "./drawing.js";
import {firstLine, loadRuntime, Problem, TffEnsModel} from "./tffens.js";

const $ = (id) => document.getElementById(id);
const api = {info: null, files: [], alpha: null};
window.tffEns = api;
api.ready = main();
// The page shows a failure itself; a caller of `ready` still sees the rejection.
api.ready.catch(() => {});

async function main() {
  try {
    const config = await (await fetch("config.json")).json();
    api.files = config.files.map(({name, problem}) => ({name, problem}));
    const wanted = new URLSearchParams(location.search).get("file");
    const file = config.files.find((f) => f.name === wanted) || config.files[0];
    fileSelector(config.files, file);
    describe(config.run, file);
    if (file.problem) throw new Problem(file.problem);
    await loadRuntime("litert/wasm/");
    const started = performance.now();
    const model = await TffEnsModel.open(file.url, file.metadata, file.name);
    api.loadMs = performance.now() - started;
    api.info = file.metadata;
    api.predict = (inputs, alpha) => model.predict(inputs, alpha === undefined ? api.alpha : alpha);
    api.personalize = (inputs, labels, temperature) =>
      model.personalize(inputs, labels, temperature === undefined ? runTemperature(file.metadata) : temperature);
    setStatus(`${file.name} loaded in ${Math.round(api.loadMs)} ms; it runs here, in WebAssembly.`);
    if (file.metadata.task === "shakespeare") shakespearePage(model);
    else femnistPage(model, file);
    return api.info;
  } catch (e) {
    setStatus(e instanceof Problem ? e.message : `The page cannot start: ${firstLine(e)}`, true);
    throw e instanceof Problem ? e : new Problem(firstLine(e));
  }
}

function setStatus(text, problem = false) {
  $("status").textContent = text;
  $("status").classList.toggle("problem", problem);
}

function fileSelector(files, current) {
  if (files.length < 2) return;
  const select = $("file-select");
  for (const f of files) select.append(new Option(f.name, f.name, false, f === current));
  select.hidden = false;
  select.addEventListener("change", () => {
    location.search = `?file=${encodeURIComponent(select.value)}`;
  });
}

const ALGORITHMS = {fedensemble: "Fed-ensemble", fedavg: "FedAvg", fedprox: "FedProx", fedbe: "FedBE", feddf: "FedDF"};

function describe(run, file) {
  const m = file.metadata;
  $("model-name").textContent = ALGORITHMS[run.algorithm] || run.algorithm || "";
  if (!m) return;
  const kind = m.format === "ensemble" ? `${m.ensemble_size} members, ${m.quantization}` : m.format;
  const task = m.task === "femnist" ? `FEMNIST ${m.class_labels.length === 10 ? "digits" : "characters"}` : m.task;
  $("model-line").textContent = `${task} · ${kind} · ${file.name}`;
}

function runTemperature(info) {
  return info.personalization_temperature == null ? Infinity : info.personalization_temperature;
}

// Rows of bars: [{label, value}] with value in [0, 1].
function bars(list, items) {
  list.replaceChildren(
    ...items.map(({label, value, text}) => {
      const li = document.createElement("li");
      const name = Object.assign(document.createElement("span"), {className: "label", textContent: label});
      const track = Object.assign(document.createElement("span"), {className: "track"});
      const fill = Object.assign(document.createElement("span"), {className: "fill"});
      fill.style.width = `${(100 * value).toFixed(1)}%`;
      track.append(fill);
      const number = Object.assign(document.createElement("span"), {className: "value", textContent: text ?? value.toFixed(3)});
      li.append(name, track, number);
      return li;
    }),
  );
}

function topK(probabilities, k) {
  return probabilities.map((p, i) => [p, i]).sort((a, b) => b[0] - a[0]).slice(0, k);
}

// The verdict, top-5, uncertainty and votes of one prediction (index 0 of `out`).
function showPrediction(out, info, labels, ids) {
  const p = out.probabilities[0];
  const best = topK(p, 5);
  bars($(ids.top), best.map(([v, i]) => ({label: labels(i), value: v})));
  const entropy = out.entropy[0], mi = out.mutual_information[0];
  const rule = info.not_sure;
  const score = rule ? (rule.score === "mutual_information" ? mi : entropy) : null;
  const unsure = rule != null && score != null && score > rule.threshold;
  const parts = [`entropy ${entropy.toFixed(3)} nats`];
  if (mi != null) parts.push(`mutual information ${mi.toFixed(3)} nats`);
  if (rule) {
    const name = rule.score === "mutual_information" ? "mutual information" : "entropy";
    const flagged = rule.ood_flagged == null ? "" : `, which flags ${Math.round(100 * rule.ood_flagged)}% of its letters`;
    parts.push(`not sure above ${name} ${rule.threshold.toFixed(3)} (${Math.round(100 * rule.quantile)}% of the run's test inputs are below it${flagged})`);
  }
  $(ids.uncertainty).textContent = parts.join(" · ");
  const votes = out.member_probabilities[0];
  const winner = best[0][1];
  $(ids.votes).replaceChildren(
    ...(votes.length > 1
      ? votes.map((q, k) => {
          const [v, i] = topK(q, 1)[0];
          return Object.assign(document.createElement("span"), {
            className: i === winner ? "" : "dissent",
            textContent: `member ${k + 1}: ${labels(i)} ${v.toFixed(2)}`,
          });
        })
      : []),
  );
  return {best, unsure};
}

function femnistPage(model, file) {
  const info = file.metadata;
  const labels = (i) => info.class_labels[i];
  $("femnist").hidden = false;
  const seen = $("seen");
  showImage(seen, null);
  const storageKey = `tff-ens:${file.name}:${file.size}`;
  const saved = JSON.parse(localStorage.getItem(storageKey) || "null") || {examples: [], alpha: null};
  api.alpha = saved.alpha;
  let current = null;

  // Shows `image` (784 values, 1.0 white) as the model's input and its prediction.
  const classify = async (image) => {
    current = image;
    showImage(seen, current);
    if (!current) return;
    try {
      const out = await api.predict([current]);
      const {best, unsure} = showPrediction(out, info, labels, {top: "top5", uncertainty: "uncertainty", votes: "votes"});
      const verdict = $("verdict");
      verdict.classList.toggle("unsure", unsure);
      verdict.classList.remove("muted");
      verdict.replaceChildren();
      if (unsure) {
        verdict.textContent = `Not sure: this does not look like a character I know (best guess ${labels(best[0][1])}).`;
      } else {
        verdict.append(Object.assign(document.createElement("b"), {textContent: labels(best[0][1])}), ` ${(100 * best[0][0]).toFixed(1)}%`);
      }
      $("label").value = String(best[0][1]);
    } catch (e) {
      setStatus(e instanceof Problem ? e.message : `Prediction failed: ${firstLine(e)}`, true);
    }
  };
  const pad = new Pad($("pad"), () => classify(pad.image()));
  api.show = (image) => classify(Float32Array.from(image));
  api.input = () => (current ? Array.from(current) : null);
  $("clear").addEventListener("click", () => {
    pad.clear();
    current = null;
    showImage(seen, null);
  });

  if (!model.isEnsemble) {
    $("personal").hidden = true;
    return;
  }
  const select = $("label");
  info.class_labels.forEach((c, i) => select.append(new Option(c, String(i))));
  $("temperature").value = String(runTemperature(info));
  $("personal-line").textContent =
    "Label a few of your own characters; the ensemble weighs its members by how well each predicts them (alpha = softmax(-loss / temperature)), here, with the file's personalize signature.";

  const save = () => localStorage.setItem(storageKey, JSON.stringify({examples: saved.examples, alpha: api.alpha}));
  const showPersonal = () => {
    const n = saved.examples.length;
    $("examples").textContent = n
      ? `${n} example${n > 1 ? "s" : ""}: ${saved.examples.map((e) => labels(e.label)).join(" ")}`
      : "No examples yet: draw one, pick its label, add it.";
    $("personalize").disabled = n === 0;
    const alpha = api.alpha || Array(model.ensembleSize).fill(1 / model.ensembleSize);
    bars($("alpha"), alpha.map((a, k) => ({label: `m${k + 1}`, value: a})));
  };
  $("add").addEventListener("click", () => {
    if (!current) return setStatus("Draw the character first, then add it as an example.");
    saved.examples.push({image: Array.from(current), label: Number(select.value)});
    save();
    showPersonal();
  });
  $("personalize").addEventListener("click", async () => {
    try {
      const temperature = Number($("temperature").value);
      api.alpha = await api.personalize(saved.examples.map((e) => e.image), saved.examples.map((e) => e.label), temperature);
      save();
      showPersonal();
      setStatus(`Personalized on ${saved.examples.length} examples; predictions use these weights.`);
    } catch (e) {
      setStatus(e instanceof Problem ? e.message : `Personalization failed: ${firstLine(e)}`, true);
    }
  });
  $("reset").addEventListener("click", () => {
    saved.examples = [];
    api.alpha = null;
    localStorage.removeItem(storageKey);
    showPersonal();
    setStatus("Personalization reset: the uniform ensemble (alpha = 1/K).");
  });
  showPersonal();
}

function shakespearePage(model) {
  const info = model.info;
  const input = info.input;
  const length = input.shape[1];
  const position = new Map([...input.vocabulary].map((c, i) => [c, i]));
  const encode = (text) => {
    const ids = [...text.slice(-length)].map((c) => position.get(c) ?? input.out_of_vocabulary_id);
    return [...Array(length - ids.length).fill(input.padding_id), ...ids];
  };
  const labels = (i) => {
    const c = input.vocabulary[i] ?? "?";
    return c === " " ? "␣" : c === "\n" ? "⏎" : c;
  };
  $("shakespeare").hidden = false;
  $("personal").hidden = true;
  const update = async () => {
    try {
      const out = await api.predict([encode($("text").value)]);
      showPrediction(out, info, labels, {top: "next5", uncertainty: "next-uncertainty", votes: "next-votes"});
    } catch (e) {
      setStatus(e instanceof Problem ? e.message : `Prediction failed: ${firstLine(e)}`, true);
    }
  };
  $("text").addEventListener("input", update);
  update();
}
