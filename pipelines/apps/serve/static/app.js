// The xmodal page: upload an image, draw its regions, ask a question, show the answers and attended regions.
"use strict";

const $ = (id) => document.getElementById(id);
const canvas = $("canvas");
const ctx = canvas.getContext("2d");
const state = { file: null, picture: null, image: null, regions: [], asked: null, highlight: -1 };

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
  const attended = state.asked ? state.asked.attended : [];
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
      const text = rank >= 0 ? `#${rank + 1} ${region.attention.toFixed(2)}` : region.label;
      ctx.font = "13px system-ui, sans-serif";
      const w = ctx.measureText(text).width + 6;
      const y = Math.max(y1, 16);
      ctx.fillStyle = color(i, 0.9);
      ctx.fillRect(x1, y - 16, w, 16);
      ctx.fillStyle = "#fff";
      ctx.fillText(text, x1 + 3, y - 4);
    }
  });
  canvas.dataset.drawn = String(drawn);
  canvas.dataset.attended = String(attended.length);
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

async function onImage() {
  const file = $("image").files[0];
  if (!file) return;
  Object.assign(state, { file, picture: null, image: null, regions: [], asked: null, highlight: -1 });
  $("result").hidden = true;
  $("regions").replaceChildren();
  showError("");
  $("ask").disabled = false;
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
    Object.assign(state, { image: asked.image, regions: asked.regions, asked });
    listRegions();
    showAnswer(asked);
    draw();
    setStatus(`answered in ${asked.seconds.toFixed(2)} s.`);
  } catch (err) {
    setStatus("");
    showError(err.message);
  } finally {
    $("ask").disabled = false;
  }
}

async function onLoad() {
  try {
    const health = await call("/api/health");
    $("loaded").textContent =
      `${health.model.task} model ${health.model.checkpoint} · detector ${health.detector.preset}`;
    if (health.detector.weights === "random") {
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
$("ask-form").addEventListener("submit", onAsk);
$("all-regions").addEventListener("change", draw);
onLoad();
