"use strict";
// asyncrl view: polls the JSON API of asyncrl/view/server.py and draws curves (plotly.js),
// the run's events and the recorded samples of each step, token by token.

const POLL_MS = 3000;
const CHARTS = [
  {id: "reward", title: "Reward (batch mean)", match: k => k === "reward/mean" || k === "reward/all_mean"},
  {id: "eval", title: "Held-out evaluation",
   match: k => k.startsWith("eval/") && !/(num_problems|seconds|skipped)/.test(k)},
  {id: "staleness", title: "Staleness (versions behind the trainer)",
   match: k => ["staleness/mean", "staleness/max", "staleness/token_lag_max"].includes(k)},
  {id: "staleness_hist", title: "Staleness histogram (samples per lag)", hist: true,
   match: k => k.startsWith("staleness/hist_")},
  {id: "mismatch", title: "Sampler-trainer mismatch tails", log: true,
   match: k => /^mismatch\/(logprob_diff_(mean|p99|max)|iw_(p99|max))$/.test(k)},
  {id: "throughput", title: "Throughput (tokens/s)",
   match: k => k === "perf/gen_tokens_per_s" || k === "perf/train_tokens_per_s"},
  {id: "tools", title: "Tool calls and failures (per step)",
   match: k => k === "tools/calls" || k.startsWith("tools/errors_")},
  {id: "tool_latency", title: "Tool latency (s)", match: k => /^tools\/latency_p(50|99)_s$/.test(k)},
  {id: "sync", title: "Weight sync (s)", match: k => k === "perf/weight_sync_s" || k === "perf/wait_s"},
];
const LAG_COLOURS = ["#bbf7d0", "#d9f99d", "#fef08a", "#fde68a", "#fed7aa", "#fdba74", "#fca5a5",
                     "#f87171", "#ef4444"];
const state = {
  runs: {},          // name -> {status, rows: Map(step -> row), offset, events: [], eoffset, keys: Set}
  order: [],         // run names in the server's order
  extra: [],         // metric names the user added as curves
  key: sessionStorage.getItem("asyncrl-view-key") || "",
  samples: null,     // the loaded step: {run, step, rows}
  messages: new Map(),
  want: Object.fromEntries(new URLSearchParams(location.search)),  // ?tab=&run=&step= to open
};

// ---- talking to the server ---------------------------------------------------------------------
class ApiError extends Error {}

async function api(path) {
  const headers = state.key ? {"Authorization": "Bearer " + state.key} : {};
  let resp;
  try {
    resp = await fetch(path, {headers, cache: "no-store"});
  } catch (err) {
    throw new ApiError("the view server does not answer (" + err.message + "); is asyncrl view still running?");
  }
  if (resp.status === 401) {
    document.getElementById("keybox").classList.remove("hidden");
    throw new ApiError("this view needs its API key");
  }
  let body;
  try {
    body = await resp.json();
  } catch (err) {
    throw new ApiError(`${path}: the server answered ${resp.status} without JSON`);
  }
  if (!resp.ok) {
    const detail = body.error || (body.detail && JSON.stringify(body.detail)) || resp.statusText;
    throw new ApiError(typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return body;
}

function q(params) {
  return Object.entries(params).map(([k, v]) => k + "=" + encodeURIComponent(v)).join("&");
}

// ---- messages ----------------------------------------------------------------------------------
function say(key, text, level = "warning") {
  if (state.messages.get(key) === text) return;
  state.messages.set(key, text);
  renderMessages();
}
function unsay(key) {
  if (state.messages.delete(key)) renderMessages();
}
function renderMessages() {
  const box = document.getElementById("messages");
  box.replaceChildren(...[...state.messages].map(([key, text]) => {
    const div = document.createElement("div");
    div.className = "message" + (key.startsWith("error") ? " error" : "");
    div.dataset.key = key;
    div.textContent = text;
    return div;
  }));
}

// ---- runs and their records --------------------------------------------------------------------
async function pollRuns() {
  const body = await api("/api/runs");
  document.getElementById("root").textContent = body.root;
  if (body.message) say("runs", body.message); else unsay("runs");
  state.order = body.runs.map(r => r.name);
  for (const status of body.runs) {
    const run = state.runs[status.name] ||= {rows: new Map(), offset: 0, events: [], eoffset: 0,
                                             keys: new Set(), problems: []};
    run.status = status;
  }
  renderRunCards();
  await Promise.all(state.order.map(pollRun));
}

async function pollRun(name) {
  const run = state.runs[name];
  try {
    const m = await api("/api/metrics?" + q({run: name, offset: run.offset}));
    if (m.reset) { run.rows.clear(); run.keys.clear(); run.problems = []; }
    for (const row of m.rows) {  // an eval row and a step row of the same step merge
      const merged = Object.assign(run.rows.get(row.step) || {}, row);
      run.rows.set(row.step, merged);
      for (const k of Object.keys(row)) run.keys.add(k);
    }
    run.offset = m.offset;
    const e = await api("/api/events?" + q({run: name, offset: run.eoffset}));
    if (e.reset) run.events = [];
    run.events.push(...e.rows);
    run.eoffset = e.offset;
    run.problems.push(...m.problems, ...e.problems);  // said once by the server: kept here
    if (run.problems.length) say("problems:" + name, `run ${name}: ` + run.problems.join("; "));
    if (m.partial_tail && run.status.state !== "running")
      say("tail:" + name, `run ${name}: metrics.jsonl ends inside a line (the run stopped while writing it); the curves end at the last complete line`);
    if (!run.rows.size && !run.offset)
      say("empty:" + name, `run ${name} has no metrics yet (${run.status.detail})`);
    else unsay("empty:" + name);
    unsay("error:" + name);
  } catch (err) {
    say("error:" + name, `run ${name}: ${err.message}`, "error");
  }
}

function renderRunCards() {
  const box = document.getElementById("runs");
  box.replaceChildren(...state.order.map(name => {
    const s = state.runs[name].status;
    const div = document.createElement("div");
    div.className = "run";
    div.dataset.run = name;
    const ago = s.updated_s_ago == null ? "" : ` · updated ${Math.round(s.updated_s_ago)} s ago`;
    div.innerHTML = `<b></b> <span class="state ${s.state}">${s.state}</span>` +
      `<span class="detail"></span>`;
    div.querySelector("b").textContent = name;
    div.querySelector(".detail").textContent = ` ${s.detail}${ago}`;
    return div;
  }));
  const select = document.getElementById("sample-run");
  const current = select.value;
  if ([...select.options].map(o => o.value).join() !== state.order.join()) {
    select.replaceChildren(...state.order.map(n => new Option(n, n)));
    if (state.order.includes(current)) select.value = current;
    if (state.want.run && state.order.includes(state.want.run)) {
      select.value = state.want.run;
      delete state.want.run;
    }
  }
}

// ---- curves ------------------------------------------------------------------------------------
function xOf(row) {
  return document.getElementById("xaxis").value === "time" ? row["time/elapsed_s"] : row.step;
}

function chartTraces(chart) {
  const traces = [];
  const many = state.order.length > 1;
  for (const name of state.order) {
    const run = state.runs[name];
    const rows = [...run.rows.values()].sort((a, b) => a.step - b.step);
    const keys = [...run.keys].filter(chart.match).sort();
    for (const key of keys) {
      const have = rows.filter(r => typeof r[key] === "number" && xOf(r) != null);
      traces.push({
        x: have.map(xOf), y: have.map(r => r[key]), name: (many ? name + " " : "") + key,
        type: chart.hist ? "bar" : "scatter", mode: "lines+markers", marker: {size: 4},
      });
    }
    if (chart.hist && keys.length) break;  // a stacked histogram is of one run: the first
  }
  return traces;
}

function eventShapes() {
  const shapes = [];
  for (const name of state.order) {
    const run = state.runs[name];
    const byStep = new Map([...run.rows.values()].map(r => [r.step, r]));
    for (const ev of run.events) {
      if (ev.kind === "eval") continue;
      const row = byStep.get(ev.step);
      const x = document.getElementById("xaxis").value === "time" ? (row ? row["time/elapsed_s"] : null) : ev.step;
      if (x == null) continue;
      shapes.push({type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
                   line: {dash: "dot", width: 1, color: ev.kind === "error" ? "#dc2626" : "#6b7280"}});
    }
  }
  return shapes;
}

function timelineTraces() {
  const traces = [];
  for (const name of state.order) {
    const evs = state.runs[name].events;
    if (!evs.length) continue;
    traces.push({x: evs.map(e => e.step), y: evs.map(e => e.kind), text: evs.map(e => e.message),
                 name, mode: "markers", type: "scatter", marker: {size: 9},
                 hovertemplate: "step %{x}: %{text}<extra>" + name + "</extra>"});
  }
  return traces;
}

function drawCharts() {
  const box = document.getElementById("charts");
  const allKeys = new Set();
  for (const name of state.order) for (const k of state.runs[name].keys) allKeys.add(k);
  const list = document.getElementById("metric-names");
  if (list.options.length !== allKeys.size)
    list.replaceChildren(...[...allKeys].sort().map(k => new Option(k, k)));
  const charts = [...CHARTS, ...state.extra.map(k => ({id: "user-" + k.replace(/\W/g, "_"), title: k, match: x => x === k}))];
  const xTitle = document.getElementById("xaxis").value === "time" ? "training time (s)" : "step";
  const shapes = eventShapes();
  for (const chart of [...charts, {id: "timeline", title: "Events (hover for what happened)", timeline: true}]) {
    let div = document.getElementById("chart-" + chart.id);
    if (!div) {
      div = document.createElement("div");
      div.id = "chart-" + chart.id;
      div.className = "chart";
      box.appendChild(div);
    }
    const traces = chart.timeline ? timelineTraces() : chartTraces(chart);
    div.dataset.traces = traces.length;
    div.dataset.points = traces.reduce((n, t) => n + t.x.length, 0);
    const layout = {
      title: {text: chart.title, font: {size: 14}}, margin: {l: 50, r: 10, t: 35, b: 35},
      xaxis: {title: {text: chart.timeline ? "step" : xTitle}}, showlegend: true,
      legend: {font: {size: 10}}, barmode: "stack", uirevision: chart.id,
      yaxis: {type: chart.log ? "log" : "linear"}, shapes: chart.timeline ? [] : shapes,
    };
    if (!traces.length) layout.annotations = [{text: "no data yet", showarrow: false,
                                               xref: "paper", yref: "paper", x: 0.5, y: 0.5}];
    Plotly.react(div, traces, layout, {responsive: true, displaylogo: false});
  }
  box.dataset.drawn = "true";
}

// ---- events table ------------------------------------------------------------------------------
function drawEvents() {
  const rows = [];
  for (const name of state.order) for (const ev of state.runs[name].events) rows.push([name, ev]);
  rows.sort((a, b) => (a[1].time || 0) - (b[1].time || 0));
  const body = document.querySelector("#events-table tbody");
  body.replaceChildren(...rows.map(([name, ev]) => {
    const tr = document.createElement("tr");
    tr.className = "event " + ev.kind;
    const when = ev.time ? new Date(ev.time * 1000).toLocaleString() : "";
    for (const text of [name, when, ev.step, ev.kind, ev.message]) {
      const td = document.createElement("td");
      td.textContent = text == null ? "" : String(text);
      tr.appendChild(td);
    }
    return tr;
  }));
}

// ---- trajectories ------------------------------------------------------------------------------
async function loadSteps() {
  const run = document.getElementById("sample-run").value;
  if (!run) return;
  const select = document.getElementById("step");
  try {
    const body = await api("/api/steps?" + q({run}));
    const had = [...select.options].map(o => o.value);
    const now = body.steps.map(String);
    if (had.join() !== now.join()) {
      const current = select.value;
      select.replaceChildren(...body.steps.slice().reverse().map(s => new Option("step " + s, s)));
      select.value = now.includes(current) ? current : (now.at(-1) || "");
      if (state.want.step && now.includes(state.want.step)) {
        select.value = state.want.step;
        delete state.want.step;
      }
    }
    if (!body.steps.length) {
      say("samples", `run ${run} recorded no samples yet (logging.sample_groups writes a few groups of each step to samples/; runs made before asyncrl view have none)`);
      document.getElementById("groups").replaceChildren();
      return;
    }
    unsay("samples");
    if (!state.samples || state.samples.run !== run || String(state.samples.step) !== select.value)
      await loadSamples();
  } catch (err) {
    say("error:samples", err.message, "error");
  }
}

async function loadSamples() {
  const run = document.getElementById("sample-run").value;
  const step = document.getElementById("step").value;
  if (!run || step === "") return;
  try {
    const body = await api("/api/samples?" + q({run, step}));
    state.samples = {run, step: body.step, rows: body.rows};
    if (body.problems.length) say("sample-problems", body.problems.join("; ")); else unsay("sample-problems");
    unsay("error:samples");
    const groups = [...new Set(body.rows.map(r => r.group))];
    const gsel = document.getElementById("group");
    const keep = gsel.value;
    gsel.replaceChildren(new Option("all", ""), ...groups.map(g => new Option("group " + g, g)));
    if (groups.map(String).includes(keep)) gsel.value = keep;
    drawSamples();
  } catch (err) {
    say("error:samples", err.message, "error");
  }
}

function lagColour(lag) {
  return LAG_COLOURS[Math.max(0, Math.min(LAG_COLOURS.length - 1, lag))];
}

function mismatchColour(d) {
  // |trainer - sampler|: white below 1e-4, full red at 1 (log scale)
  const t = Math.max(0, Math.min(1, (Math.log10(Math.max(d, 1e-6)) + 4) / 4));
  const g = Math.round(255 - 190 * t);
  return `rgb(255,${g},${g})`;
}

function drawLegend(mode) {
  const box = document.getElementById("legend");
  const items = mode === "version"
    ? LAG_COLOURS.map((c, i) => [c, i === LAG_COLOURS.length - 1 ? `${i}+ behind` : `${i} behind`])
    : [1e-4, 1e-3, 1e-2, 1e-1, 1].map(d => [mismatchColour(d), "|Δ| " + d]);
  const label = document.createElement("span");
  label.textContent = mode === "version"
    ? "token colour: policy versions between the one that sampled it and the trainer's at this step;"
    : "token colour: |trainer - sampler| logprob (hatched: not recorded);";
  const marker = document.createElement("span");
  marker.innerHTML = ' <span class="update"></span> a weight update reached the generation here';
  box.replaceChildren(label, ...items.map(([c, text]) => {
    const s = document.createElement("span");
    s.className = "swatch";
    s.style.background = c;
    s.textContent = text;
    return s;
  }), marker);
}

function tokenSpan(row, i, mode) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = row.tokens[i];
  span.dataset.i = i;
  span.dataset.version = row.versions[i];
  const generated = row.loss_mask[i] === 1;
  if (!generated) {
    span.classList.add("context");
    return span;
  }
  const sampler = row.sampler_logprobs ? row.sampler_logprobs[i] : null;
  const trainer = row.trainer_logprobs ? row.trainer_logprobs[i] : null;
  const adv = row.advantages ? row.advantages[i] : null;
  const lag = (row.policy_version ?? row.step - 1) - row.versions[i];
  const tip = [`token ${i} ${JSON.stringify(row.tokens[i])}`, `sampled by version ${row.versions[i]} (${lag} behind)`];
  if (sampler != null) tip.push(`sampler logprob ${sampler.toFixed(4)}`);
  if (trainer != null) tip.push(`trainer logprob ${trainer.toFixed(4)}`, `|diff| ${Math.abs(trainer - sampler).toExponential(2)}`);
  if (adv != null) tip.push(`advantage ${adv.toFixed(3)}`);
  span.title = tip.join("\n");
  if (mode === "version") {
    span.style.background = lagColour(lag);
  } else if (trainer != null && sampler != null) {
    const d = Math.abs(trainer - sampler);
    span.dataset.diff = d;
    span.style.background = mismatchColour(d);
  } else {
    span.classList.add("missing");
  }
  return span;
}

function tokensOf(row, start, end, mode) {
  const div = document.createElement("div");
  div.className = "tokens";
  const updates = new Set(row.weight_updates || []);
  for (let i = start; i < end; i++) {
    if (updates.has(i)) {
      const mark = document.createElement("span");
      mark.className = "update";
      mark.dataset.i = i;
      mark.title = `weight update: version ${row.versions[i - 1]} -> ${row.versions[i]} from here on`;
      div.appendChild(mark);
    }
    div.appendChild(tokenSpan(row, i, mode));
  }
  return div;
}

function meanAdvantage(row) {
  if (!row.advantages) return null;
  const vals = row.advantages.filter((_, i) => row.loss_mask[i] === 1);
  return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
}

function imagesOf(row) {
  const div = document.createElement("div");
  div.className = "images";
  for (const name of row.images || []) {
    const img = document.createElement("img");
    img.alt = name;
    img.dataset.name = name;
    const headers = state.key ? {"Authorization": "Bearer " + state.key} : {};
    fetch("/api/image?" + q({run: state.samples.run, name}), {headers})
      .then(r => r.ok ? r.blob() : Promise.reject(new Error("image " + name + ": " + r.status)))
      .then(b => { img.src = URL.createObjectURL(b); })
      .catch(err => say("error:image", err.message, "error"));
    div.appendChild(img);
  }
  return div;
}

function collapseRepeats(pieces) {
  // a VLM prompt's run of image pads reads better as one piece and its count
  let out = "";
  for (let i = 0; i < pieces.length;) {
    let j = i;
    while (j < pieces.length && pieces[j] === pieces[i]) j++;
    out += j - i >= 4 ? `${pieces[i]}×${j - i}` : pieces.slice(i, j).join("");
    i = j;
  }
  return out;
}

function drawSamples() {
  const mode = document.getElementById("colour").value;
  drawLegend(mode);
  const box = document.getElementById("groups");
  if (!state.samples) return box.replaceChildren();
  const rmin = parseFloat(document.getElementById("rmin").value);
  const rmax = parseFloat(document.getElementById("rmax").value);
  const gsel = document.getElementById("group").value;
  const rows = state.samples.rows.filter(r =>
    (isNaN(rmin) || r.reward >= rmin) && (isNaN(rmax) || r.reward <= rmax) &&
    (gsel === "" || String(r.group) === gsel));
  const groups = new Map();
  for (const r of rows) (groups.get(r.group) || groups.set(r.group, []).get(r.group)).push(r);
  const out = [];
  for (const [g, members] of groups) {
    const div = document.createElement("div");
    div.className = "group";
    div.dataset.group = g;
    const h = document.createElement("h3");
    const rewards = members.map(r => r.reward.toFixed(2)).join(", ");
    h.textContent = `group ${g} · id ${members[0].id} · rewards ${rewards}`;
    div.appendChild(h);
    const first = members[0];
    const prompt = first.turns && first.turns[0] && first.turns[0].role === "context" ? first.turns[0] : null;
    if (prompt) {
      const p = document.createElement("div");
      p.className = "prompt";
      p.textContent = collapseRepeats(first.tokens.slice(prompt.start, prompt.end));
      div.appendChild(p);
    }
    if ((first.images || []).length) div.appendChild(imagesOf(first));
    for (const r of members) div.appendChild(sampleDiv(r, mode, prompt ? prompt.end : 0));
    out.push(div);
  }
  if (!out.length) {
    const p = document.createElement("p");
    p.textContent = state.samples.rows.length ? "no sample of this step passes the filter" : "this step has no samples";
    out.push(p);
  }
  box.replaceChildren(...out);
}

function toolCalls(text) {
  // hermes-style calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>), as the proxy
  // parses them by default; a call that is not JSON is shown as written
  const out = [];
  for (const m of text.matchAll(/<tool_call>([\s\S]*?)<\/tool_call>/g)) {
    try {
      const call = JSON.parse(m[1]);
      out.push(`${call.name}(${JSON.stringify(call.arguments ?? {})})`);
    } catch (err) {
      out.push(m[1].trim() + " (not JSON)");
    }
  }
  return out;
}

function sampleDiv(r, mode, promptEnd) {
  const div = document.createElement("div");
  div.className = "sample";
  div.dataset.sample = r.sample;
  const gen = r.versions.filter((_, i) => r.loss_mask[i] === 1);
  const adv = meanAdvantage(r);
  const meta = document.createElement("div");
  meta.className = "meta";
  const parts = [`sample ${r.sample}`, `reward ${r.reward.toFixed(3)}`];
  if (adv != null) parts.push(`advantage ${adv.toFixed(3)}`);
  parts.push(`stop ${r.stop_reason}`, `${gen.length} generated tokens`);
  if (gen.length) parts.push(`versions ${Math.min(...gen)}-${Math.max(...gen)}`);
  if ((r.weight_updates || []).length) parts.push(`${r.weight_updates.length} weight update(s) mid-generation`);
  for (const [k, v] of Object.entries(r.metadata || {})) parts.push(`${k} ${JSON.stringify(v)}`);
  meta.textContent = parts.join(" · ");
  div.appendChild(meta);
  const turns = (r.turns || []).filter(t => t.end > promptEnd);
  if (turns.length > 1) {  // a conversation: turns, tool results, per-turn rewards
    let k = 0;
    for (const t of turns) {
      const turn = document.createElement("div");
      turn.className = "turn " + t.role;
      const role = document.createElement("div");
      role.className = "role";
      role.textContent = t.role === "model"
        ? `model turn ${++k}` + (t.reward != null && t.reward !== 0 ? ` · reward ${t.reward}` : "")
        : "context (user, tool or environment tokens)";
      turn.appendChild(role);
      turn.appendChild(tokensOf(r, Math.max(t.start, promptEnd), t.end, mode));
      for (const call of toolCalls(r.tokens.slice(t.start, t.end).join(""))) {
        const c = document.createElement("div");
        c.className = "tool-call";
        c.textContent = "tool call: " + call;
        turn.appendChild(c);
      }
      div.appendChild(turn);
    }
  } else {
    div.appendChild(tokensOf(r, promptEnd, r.tokens.length, mode));
  }
  return div;
}

// ---- the page ----------------------------------------------------------------------------------
let tab = "curves";
function showTab(name) {
  tab = name;
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const s of document.querySelectorAll("main > section")) s.classList.toggle("hidden", s.id !== "tab-" + name);
  if (state.order.length) render().catch(err => say("error:server", err.message, "error"));
  refresh();
}

async function render() {
  if (tab === "curves") drawCharts();
  else if (tab === "events") drawEvents();
  else await loadSteps();
}

let refreshing = false;
async function refresh() {
  if (refreshing) return;  // a slow poll is still reading: offsets must not be read twice
  refreshing = true;
  try {
    await pollRuns();
    unsay("error:server");
    await render();
  } catch (err) {
    say("error:server", err.message, "error");
  } finally {
    refreshing = false;
  }
}

function init() {
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  document.getElementById("xaxis").addEventListener("change", drawCharts);
  document.getElementById("add-metric").addEventListener("click", () => {
    const k = document.getElementById("metric").value.trim();
    if (k && !state.extra.includes(k)) state.extra.push(k);
    drawCharts();
  });
  document.getElementById("sample-run").addEventListener("change", () => { state.samples = null; loadSteps(); });
  document.getElementById("step").addEventListener("change", loadSamples);
  document.getElementById("latest").addEventListener("click", () => {
    const s = document.getElementById("step");
    if (s.options.length) { s.selectedIndex = 0; loadSamples(); }
  });
  for (const id of ["rmin", "rmax", "group", "colour"])
    for (const kind of ["input", "change"]) document.getElementById(id).addEventListener(kind, drawSamples);
  document.getElementById("keybox").addEventListener("submit", event => {
    event.preventDefault();
    state.key = document.getElementById("key").value;
    sessionStorage.setItem("asyncrl-view-key", state.key);
    document.getElementById("keybox").classList.add("hidden");
    refresh();
  });
  const want = state.want.tab;
  showTab(["curves", "samples", "events"].includes(want) ? want : "curves");
  setInterval(refresh, POLL_MS);
}

init();
