// The page at /: asks POST /v1/answer and draws the answer, its passages and (RAG-Token) the
// passage each answer token came from. `?q=...&variant=token` asks on load.
"use strict";

const COLOURS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6",
                 "#9a6324", "#469990", "#808000"];
const $ = (id) => document.getElementById(id);
let info = null;
let last = null;  // the last request, asked again after an edit

function colour(n) { return COLOURS[n % COLOURS.length]; }

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

async function api(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: body ? {"Content-Type": "application/json"} : {},
    body: body ? JSON.stringify(body) : undefined,
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

function bar(label, value, hue) {
  const pct = (100 * value).toFixed(1);
  return [el("span", {}, label),
          el("div", {class: "bar"}, el("span", {style: `width:${pct}%;background:${hue}`})),
          el("span", {}, value.toFixed(3))];
}

function card(p, n) {
  const hue = colour(n);
  const text = el("div", {class: "text"}, p.text);
  const node = el("li", {class: "passage-card", style: `border-left-color:${hue}`,
                         "data-id": p.id, "data-passage": String(n)},
    el("header", {}, el("span", {class: "title"}, `${n + 1}. ${p.title || "(no title)"}`),
       el("span", {class: "id"}, p.id)),
    el("div", {class: "bars"}, ...bar("prior", p.prior, hue), ...bar("posterior", p.posterior, hue)),
    text);
  if (info && info.allow_edits) {
    const edit = el("button", {type: "button", class: "secondary"}, "Edit");
    edit.onclick = () => editPassage(p, text, edit);
    node.append(edit);
  }
  return node;
}

async function editPassage(p, text, button) {
  if (text.contentEditable !== "true") {
    text.contentEditable = "true";
    text.focus();
    button.textContent = "Save and ask again";
    return;
  }
  button.disabled = true;
  try {
    await api("PUT", `/v1/passages/${encodeURIComponent(p.id)}`, {text: text.innerText.trim()});
    $("status").textContent = `passage ${p.id} saved; asking again`;
    if (last) await ask(last);
  } catch (e) {
    $("status").textContent = e.message;
    $("status").className = "error";
    button.disabled = false;
  }
}

function draw(a) {
  $("answer").textContent = a.answer || "(empty answer)";
  $("meta").textContent = `log p(y|x) = ${a.log_likelihood.toFixed(3)}, ${a.variant}` +
    (a.truncated ? `, question truncated to ${info.question_token_limit} tokens` : "");
  // Cards ranked by prior; each keeps its retrieval position n for its colour.
  const order = a.passages.map((p, n) => [p, n]).sort((x, y) => y[0].prior - x[0].prior);
  $("passages").replaceChildren(...order.map(([p, n]) => card(p, n)));
  const tokens = $("tokens");
  tokens.replaceChildren();
  for (const t of a.tokens || []) {
    const best = t.posteriors.indexOf(Math.max(...t.posteriors));
    const hover = t.posteriors.map((q, n) => `${n + 1}. ${a.passages[n].title}: ${q.toFixed(3)}`);
    tokens.append(el("span", {class: "token", "data-passage": String(best),
                              title: `${t.token}\n` + hover.join("\n"),
                              style: `border-color:${colour(best)};` +
                                     `background:${colour(best)}${alpha(t.posteriors[best])}`},
                     t.token));
  }
  $("result").hidden = false;
}

function alpha(p) {  // two hex digits: 0x20 (uncertain) to 0x80 (sure)
  return Math.round(32 + 96 * p).toString(16).padStart(2, "0");
}

async function ask(request) {
  last = request;
  document.body.dataset.state = "asking";
  $("status").className = "muted";
  $("status").textContent = "asking…";
  try {
    const data = await api("POST", "/v1/answer", request);
    draw(data.answers[0]);
    const s = data.setting;
    $("status").textContent = `answered: ${s.n_docs} passages, ${s.num_beams} beam(s)`;
    document.body.dataset.state = "answered";
  } catch (e) {
    $("status").textContent = e.message;
    $("status").className = "error";
    document.body.dataset.state = "error";
  }
}

$("ask").onsubmit = (event) => {
  event.preventDefault();
  ask({questions: [$("question").value], variant: $("variant").value,
       num_beams: Number($("num_beams").value), n_docs: Number($("n_docs").value)});
};

(async () => {
  try {
    info = await api("GET", "/v1/info");
  } catch (e) {
    $("info").textContent = e.message;
    return;
  }
  $("info").textContent = `step ${info.step}, ${info.passages} passages, default ` +
    `RAG-${info.variant === "token" ? "Token" : "Sequence"}` +
    (info.allow_edits ? "; edits on" : "; read only");
  $("n_docs").value = info.n_docs;
  $("n_docs").max = info.max_n_docs;
  $("num_beams").max = info.max_beams;
  const params = new URLSearchParams(location.search);
  if (params.get("variant")) $("variant").value = params.get("variant");
  if (params.get("q")) {
    $("question").value = params.get("q");
    $("ask").requestSubmit();
  }
})();
