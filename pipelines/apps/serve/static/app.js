// The xmodal page: upload an image, draw its regions, ask a question, show the answers and attended regions;
// with a captioner, describe the image and step through each word's attention over the regions; with a
// text-to-image model, draw n images for a prompt, best first by the server's re-ranker.
"use strict";

const $ = (id) => document.getElementById(id);
const canvas = $("canvas");
const ctx = canvas.getContext("2d");
// `view` is what the canvas shows attended: the answer's regions, or the current caption word's
const state = {
  file: null, picture: null, image: null, regions: [], asked: null, captioned: null, word: -1,
  view: null, highlight: -1, timer: null, canAsk: false, canDescribe: false,
};

function color(i, alpha = 1) {
  return `hsla(${(i * 137.5) % 360}, 90%, 45%, ${alpha})`;
}

async function call(url, form) {
  let response;
  try {
    response = await fetch(url, form ? { method: "POST", body: form } : {});
  } catch (err) {
    throw new Error(`the server cannot be reached (${err.message})`);
  }
  let body;
  try {
    body = await response.json();
  } catch {
    throw new Error(`the server answered ${response.status} without JSON`);
  }
  if (!response.ok) throw new Error(body.error || `the server answered ${response.status}`);
  return body;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setStatus(text) {
  $("status").textContent = text;
}

function loadPicture(file) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error(`${file.name} cannot be shown by the browser`));
    img.src = URL.createObjectURL(file);
  });
}

// Boxes come in the pixels of the image the server decoded; the canvas shows it fitted to 800x600.
function draw() {
  const img = state.picture;
  if (!img) return;
  const width = state.image ? state.image.width : img.naturalWidth;
  const height = state.image ? state.image.height : img.naturalHeight;
  const scale = Math.min(800 / width, 600 / height);
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  ctx.imageSmoothingEnabled = scale < 2;
  ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
  const attended = state.view ? state.view.attended : [];
  const rect = (i) => state.regions[i].box.map((v) => v * scale);
  if (attended.length) {
    // dim everything, then bring the attended regions back at full brightness
    ctx.fillStyle = "rgba(0, 0, 0, 0.55)";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    for (const i of attended) {
      const [x1, y1, x2, y2] = rect(i);
      ctx.drawImage(img, x1 / scale, y1 / scale, (x2 - x1) / scale, (y2 - y1) / scale, x1, y1, x2 - x1, y2 - y1);
    }
  }
  let drawn = 0;
  const placed = [];
  const showAll = $("all-regions").checked;
  state.regions.forEach((region, i) => {
    const rank = attended.indexOf(i);
    if (!showAll && rank < 0 && i !== state.highlight) return;
    const [x1, y1, x2, y2] = rect(i);
    const strong = rank >= 0 || i === state.highlight;
    ctx.lineWidth = strong ? 3 : 1.5;
    ctx.strokeStyle = color(i, strong ? 1 : 0.8);
    ctx.strokeRect(x1, y1, x2 - x1, y2 - y1);
    drawn += 1;
    if (rank >= 0 || i === state.highlight) {
      // the rank alone on attended boxes (their labels are listed beside): overlapping boxes stay legible
      const text = rank >= 0 ? `#${rank + 1} ${state.view.weights[i].toFixed(2)}` : region.label;
      ctx.font = "13px system-ui, sans-serif";
      const w = ctx.measureText(text).width + 6;
      const x = Math.min(x1, canvas.width - w);
      let y = Math.max(y1, 16);
      // boxes sharing a corner would print their labels over each other: move down to a free line
      while (placed.some((p) => x < p.x + p.w && p.x < x + w && y - 16 < p.y && p.y - 16 < y)) y += 17;
      placed.push({ x, y, w });
      ctx.fillStyle = color(i, 0.9);
      ctx.fillRect(x, y - 16, w, 16);
      ctx.fillStyle = "#fff";
      ctx.fillText(text, x + 3, y - 4);
    }
  });
  canvas.dataset.drawn = String(drawn);
  canvas.dataset.attended = String(attended.length);
  canvas.dataset.labels = JSON.stringify(placed.map((p) => [p.x, p.y - 16, p.x + p.w, p.y]));
  canvas.dataset.word = String(state.view && state.view.word !== undefined ? state.view.word : -1);
}

function regionItem(region, i, extra) {
  const li = document.createElement("li");
  const swatch = document.createElement("span");
  swatch.className = "swatch";
  swatch.style.background = color(i);
  li.append(swatch, `${region.label} (${region.object_score.toFixed(2)})${extra || ""}`);
  li.addEventListener("mouseenter", () => { state.highlight = i; draw(); });
  li.addEventListener("mouseleave", () => { state.highlight = -1; draw(); });
  return li;
}

function listRegions() {
  $("regions").replaceChildren(...state.regions.map((r, i) => regionItem(r, i)));
}

function showAnswer(asked) {
  $("answer").textContent = asked.answer;
  $("answer-score").textContent = `score ${asked.score.toFixed(3)}`;
  const best = Math.max(...asked.answers.map((a) => a.score), 1e-9);
  $("answers").replaceChildren(...asked.answers.map((a) => {
    const li = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.round((80 * a.score) / best)}px`;
    li.append(bar, `${a.answer} ${a.score.toFixed(3)}`);
    return li;
  }));
  $("attended").replaceChildren(...asked.attended.map((i) =>
    regionItem(asked.regions[i], i, ` attention ${asked.regions[i].attention.toFixed(3)}`)));
  $("result").hidden = false;
}

function stopPlaying() {
  clearInterval(state.timer);
  state.timer = null;
  $("play").textContent = "Play";
}

// Show word t of the caption: its chip, the slider, and on the canvas the regions it attended to most.
function selectWord(t) {
  const words = state.captioned.words;
  const word = words[t];
  state.word = t;
  state.view = { attended: word.attended, weights: word.attention, word: t };
  $("words").querySelectorAll(".word").forEach((chip, k) => chip.classList.toggle("current", k === t));
  $("word-step").value = String(t);
  $("word-attended").replaceChildren(...word.attended.map((i) =>
    regionItem(state.regions[i], i, ` attention ${word.attention[i].toFixed(3)}`)));
  draw();
}

function showCaption(captioned) {
  stopPlaying();
  $("caption").textContent = captioned.caption || "(the captioner produced no word)";
  $("words").replaceChildren(...captioned.words.map((w, t) => {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.className = "word";
    chip.textContent = w.word;
    chip.addEventListener("click", () => { stopPlaying(); selectWord(t); });
    return chip;
  }));
  $("word-step").max = String(Math.max(captioned.words.length - 1, 0));
  $("word-step").disabled = $("play").disabled = captioned.words.length === 0;
  $("caption-result").hidden = false;
  if (captioned.words.length) selectWord(0);
}

function togglePlay() {
  if (state.timer) return stopPlaying();
  const words = state.captioned ? state.captioned.words : [];
  if (!words.length) return;
  if (state.word >= words.length - 1) selectWord(0);
  $("play").textContent = "Stop";
  state.timer = setInterval(() => {
    if (state.word >= words.length - 1) return stopPlaying();
    selectWord(state.word + 1);
  }, 900);
}

async function onImage() {
  const file = $("image").files[0];
  if (!file) return;
  stopPlaying();
  Object.assign(state, {
    file, picture: null, image: null, regions: [], asked: null, captioned: null, word: -1, view: null,
    highlight: -1,
  });
  $("result").hidden = true;
  $("caption-result").hidden = true;
  $("regions").replaceChildren();
  showError("");
  $("ask").disabled = !state.canAsk;
  $("describe").disabled = !state.canDescribe;
  try {
    state.picture = await loadPicture(file);
    draw();
    setStatus(`finding the regions of ${file.name}…`);
    const form = new FormData();
    form.append("image", file);
    const found = await call("/api/regions", form);
    if (state.file !== file) return;  // another image was chosen meanwhile
    Object.assign(state, { image: found.image, regions: found.regions });
    listRegions();
    draw();
    setStatus(`${found.regions.length} regions in ${found.seconds.toFixed(2)} s; now ask a question.`);
  } catch (err) {
    setStatus("");
    showError(err.message);
  }
}

async function onAsk(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!state.file) return showError("choose an image first");
  if (!question) return showError("type a question about the image");
  showError("");
  $("ask").disabled = true;
  setStatus("thinking…");
  const file = state.file;
  try {
    const form = new FormData();
    form.append("image", file);
    form.append("question", question);
    const asked = await call("/api/ask", form);
    if (state.file !== file) return;
    stopPlaying();
    const weights = asked.regions.map((r) => r.attention);
    Object.assign(state, {
      image: asked.image, regions: asked.regions, asked, word: -1, view: { attended: asked.attended, weights },
    });
    $("words").querySelectorAll(".word").forEach((chip) => chip.classList.remove("current"));
    listRegions();
    showAnswer(asked);
    draw();
    setStatus(`answered in ${asked.seconds.toFixed(2)} s.`);
  } catch (err) {
    setStatus("");
    showError(err.message);
  } finally {
    $("ask").disabled = !state.canAsk;
  }
}

async function onDescribe() {
  if (!state.file) return showError("choose an image first");
  showError("");
  $("describe").disabled = true;
  setStatus("describing…");
  const file = state.file;
  try {
    const form = new FormData();
    form.append("image", file);
    const captioned = await call("/api/caption", form);
    if (state.file !== file) return;
    Object.assign(state, { image: captioned.image, regions: captioned.regions, captioned });
    listRegions();
    showCaption(captioned);
    draw();
    setStatus(`described in ${captioned.seconds.toFixed(2)} s.`);
  } catch (err) {
    setStatus("");
    showError(err.message);
  } finally {
    $("describe").disabled = !state.canDescribe;
  }
}

async function onGenerate(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("generate-error").hidden = true;
  $("generate").disabled = true;
  $("generate-status").textContent = "drawing…";
  const form = new FormData();
  form.append("prompt", prompt);
  form.append("n", $("samples").value || "4");
  form.append("seed", $("seed").value || "0");
  try {
    const drawn = await call("/api/generate", form);
    const gallery = $("gallery");
    gallery.replaceChildren();
    drawn.images.forEach((entry, rank) => {
      const figure = document.createElement("figure");
      const img = document.createElement("img");
      img.src = entry.png;
      img.alt = `sample ${entry.sample} for "${drawn.prompt}"`;
      const label = document.createElement("figcaption");
      const score = entry.score === null ? "no region" : entry.score.toFixed(2);
      label.textContent = `#${rank + 1} · sample ${entry.sample} · score ${score}`;
      figure.append(img, label);
      gallery.append(figure);
    });
    $("generate-status").textContent =
      `${drawn.images.length} images in ${drawn.seconds.toFixed(1)} s, re-ranked by ${drawn.reranker}`;
  } catch (err) {
    $("generate-status").textContent = "";
    $("generate-error").textContent = err.message;
    $("generate-error").hidden = false;
  } finally {
    $("generate").disabled = false;
  }
}

async function onLoad() {
  try {
    const health = await call("/api/health");
    const held = [health.model, health.caption].filter(Boolean).map((m) => `${m.task} model ${m.checkpoint}`);
    if (health.generate) held.push(`text-to-image ${health.generate.checkpoint}`);
    if (health.detector) held.push(`detector ${health.detector.preset}`);
    $("loaded").textContent = held.join(" · ");
    state.canAsk = Boolean(health.model);
    state.canDescribe = Boolean(health.caption);
    $("ask-form").hidden = !state.canAsk;
    $("describe-row").hidden = !state.canDescribe;
    $("generate-tab").hidden = !health.generate;
    document.querySelector("main").hidden = !health.detector;
    if (health.detector && health.detector.weights === "random") {
      $("warning").textContent =
        "The detector has random weights: its regions and the answers are meaningless (a test setup).";
      $("warning").hidden = false;
    }
  } catch (err) {
    $("loaded").textContent = "";
    showError(err.message);
  }
}

$("image").addEventListener("change", onImage);
$("generate-form").addEventListener("submit", onGenerate);
$("ask-form").addEventListener("submit", onAsk);
$("all-regions").addEventListener("change", draw);
$("describe").addEventListener("click", onDescribe);
$("play").addEventListener("click", togglePlay);
$("word-step").addEventListener("input", () => { stopPlaying(); selectWord(Number($("word-step").value)); });
onLoad();
