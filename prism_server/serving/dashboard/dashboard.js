// Prism's dashboard: polls /v1/status once a second and draws, in plain SVG, the memory each
// model holds on each device over time (stacked), request rates, the residency timeline, SLO
// attainment over the last minute, the models (a row each, their LoRA adapters' rows under them)
// and the latest page moves. No libraries, no network beyond
// the server. The API key, if the server has one, comes from the page's #key=... fragment.
"use strict";

const WINDOW_S = 300; // seconds of history drawn
const POLL_MS = 1000;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
const STATE_COLOR = { resident: "#2ca02c", activating: "#ffbf00", draining: "#ff7f0e",
  offloaded: "#d0d0d0", failed: "#d62728" };
const SVG = "http://www.w3.org/2000/svg";

const state = { samples: [], colors: {}, key: null };
window.prismDashboard = state; // what the page has seen (read by tests and curious operators)

function keyFromHash() {
  const m = /(?:^#|&)key=([^&]+)/.exec(location.hash);
  if (m) sessionStorage.setItem("prism-key", decodeURIComponent(m[1]));
  return sessionStorage.getItem("prism-key");
}

function color(model) {
  if (!(model in state.colors)) {
    state.colors[model] = PALETTE[Object.keys(state.colors).length % PALETTE.length];
  }
  return state.colors[model];
}

function size(n) {
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(1) + " MiB";
  return (n / 1024).toFixed(0) + " KiB";
}

function el(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

// the time span drawn: the history so far (at least 30 s), at most WINDOW_S
function span() {
  const t1 = state.samples[state.samples.length - 1].time;
  const w = Math.max(30, Math.min(WINDOW_S, t1 - state.samples[0].time));
  return [t1 - w, t1, w];
}

function chart(width, height) {
  return el("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
}

function legend(container, models) {
  const div = document.createElement("div");
  div.className = "legend";
  for (const m of models) {
    const s = document.createElement("span");
    s.style.setProperty("--c", color(m));
    s.textContent = m;
    s.dataset.model = m;
    div.appendChild(s);
  }
  container.appendChild(div);
}

// one sample per poll: the server's clock, and per device and model what the page draws
function sample(doc) {
  const s = { time: doc.time, devices: {}, models: {} };
  for (const d of doc.devices) {
    const page = d.pool.page_bytes;
    const dev = (s.devices[d.device] = { capacity: d.pool.capacity_pages * page, models: {} });
    for (const m of d.models) {
      const mem = { weights: m.weight_pages * page, kv: m.kv_bytes };
      dev.models[m.name] = mem;
      s.models[m.name] = {
        device: d.device, residency: m.residency, requests: m.requests_total,
        slo: m.slo_last_minute || {}, ...mem,
      };
    }
  }
  return s;
}

// memory(model): [[time, weights + KV bytes], ...] over the history (for tests and tooltips)
state.memory = (model) =>
  state.samples.map((s) => [s.time, s.models[model] ? s.models[model].weights + s.models[model].kv : 0]);

function drawMemory(container) {
  container.replaceChildren();
  const last = state.samples[state.samples.length - 1];
  for (const [dev, info] of Object.entries(last.devices)) {
    const W = 560, H = 200, L = 60, B = 20;
    const svg = chart(W, H);
    svg.dataset.device = dev;
    const [t0, , w] = span();
    const models = Object.keys(info.models);
    const x = (t) => L + ((t - t0) / w) * (W - L - 5);
    const y = (b) => H - B - (b / Math.max(info.capacity, 1)) * (H - B - 10);
    el("line", { x1: L, y1: H - B, x2: W, y2: H - B, class: "axis" }, svg);
    el("line", { x1: L, y1: 10, x2: L, y2: H - B, class: "axis" }, svg);
    el("text", { x: 2, y: 14 }, svg).textContent = size(info.capacity);
    el("text", { x: 2, y: H - B }, svg).textContent = "0";
    el("text", { x: L, y: H - 4 }, svg).textContent = `${dev}, last ${Math.round(w)} s`;
    const pts = state.samples.filter((s) => s.time >= t0 && s.devices[dev]);
    let below = pts.map(() => 0);
    for (const m of models) {
      for (const part of ["weights", "kv"]) {
        const top = pts.map((s, i) => below[i] + ((s.devices[dev].models[m] || {})[part] || 0));
        const upper = pts.map((s, i) => `${x(s.time)},${y(top[i])}`);
        const lower = pts.map((s, i) => `${x(s.time)},${y(below[i])}`).reverse();
        el("polygon", {
          points: upper.concat(lower).join(" "), fill: color(m),
          "fill-opacity": part === "weights" ? 0.85 : 0.35, "data-model": m, "data-part": part,
        }, svg);
        below = top;
      }
    }
    container.appendChild(svg);
    legend(container, models);
  }
}

// one line per model over the drawn span: series[model] = [[time, value], ...], values in
// [0, top]; `label` and `zero` mark the top and the foot of the axis
function lineChart(container, series, top, label, H, zero = "0") {
  const W = 560, L = 40, B = 18;
  const svg = chart(W, H);
  const [t0, , w] = span();
  const x = (t) => L + ((t - t0) / w) * (W - L - 5);
  const y = (v) => H - B - (v / top) * (H - B - 10);
  el("line", { x1: L, y1: H - B, x2: W, y2: H - B, class: "axis" }, svg);
  el("text", { x: 2, y: 14 }, svg).textContent = label;
  el("text", { x: 2, y: H - B }, svg).textContent = zero;
  for (const [m, pts] of Object.entries(series)) {
    const shown = pts.filter(([t]) => t >= t0).map(([t, v]) => `${x(t)},${y(v)}`);
    if (shown.length) el("polyline", { points: shown.join(" "), fill: "none", stroke: color(m),
      "stroke-width": 1.5, "data-model": m }, svg);
  }
  container.appendChild(svg);
}

function drawRates(container) {
  container.replaceChildren();
  const n = state.samples.length;
  const models = Object.keys(state.samples[n - 1].models);
  const rates = {}; // model -> [[t, req/s]]
  let peak = 0.1;
  for (const m of models) {
    rates[m] = [];
    for (let i = 1; i < n; i++) {
      const a = state.samples[i - 1], b = state.samples[i];
      if (!a.models[m] || !b.models[m] || b.time <= a.time) continue;
      const r = (b.models[m].requests - a.models[m].requests) / (b.time - a.time);
      rates[m].push([b.time, r]);
      peak = Math.max(peak, r);
    }
  }
  state.rates = rates;
  lineChart(container, rates, peak, peak.toFixed(1) + "/s", 160);
  legend(container, models);
}

function drawResidency(container) {
  container.replaceChildren();
  const n = state.samples.length, last = state.samples[n - 1];
  const models = Object.keys(last.models);
  const W = 560, row = 18, L = 120, H = row * models.length + 20;
  const svg = chart(W, H);
  const [t0, , w] = span();
  const x = (t) => L + ((Math.max(t, t0) - t0) / w) * (W - L - 5);
  models.forEach((m, r) => {
    el("text", { x: 2, y: r * row + 13 }, svg).textContent = m;
    for (let i = 1; i < n; i++) {
      const a = state.samples[i - 1], b = state.samples[i];
      if (b.time < t0 || !a.models[m]) continue;
      el("rect", { x: x(a.time), y: r * row + 2, width: Math.max(x(b.time) - x(a.time), 1),
        height: row - 4, fill: STATE_COLOR[a.models[m].residency] || "#999",
        "data-model": m, "data-state": a.models[m].residency }, svg);
    }
  });
  let lx = L;
  for (const [name, c] of Object.entries(STATE_COLOR)) {
    el("rect", { x: lx, y: H - 13, width: 10, height: 10, fill: c }, svg);
    el("text", { x: lx + 13, y: H - 4 }, svg).textContent = name;
    lx += 16 + 7 * name.length;
  }
  container.appendChild(svg);
}

// attainment over time: per model, the share of its last minute's deadlines met (TTFT and
// TPOT together), sampled at each poll
function drawSloChart(container) {
  const series = {};
  for (const m of Object.keys(state.samples[state.samples.length - 1].models)) {
    series[m] = [];
    for (const s of state.samples) {
      const info = s.models[m];
      if (!info) continue;
      let met = 0, n = 0;
      for (const k of ["ttft", "tpot"]) {
        const v = info.slo[k] || { met: 0, missed: 0 };
        met += v.met;
        n += v.met + v.missed;
      }
      if (n) series[m].push([s.time, met / n]);
    }
  }
  lineChart(container, series, 1, "100%", 120, "0%");
}

function drawSlo(container) {
  container.replaceChildren();
  drawSloChart(container);
  const last = state.samples[state.samples.length - 1];
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>model</th><th>state</th><th>TTFT</th><th>TPOT</th></tr></thead>";
  const body = document.createElement("tbody");
  for (const [m, info] of Object.entries(last.models)) {
    const cell = (k) => {
      const s = info.slo[k] || { met: 0, missed: 0 }, n = s.met + s.missed;
      return n ? `${s.met}/${n} (${Math.round((100 * s.met) / n)}%)` : "–";
    };
    const tr = document.createElement("tr");
    tr.dataset.model = m;
    for (const v of [m, info.residency, cell("ttft"), cell("tpot")]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  table.appendChild(body);
  container.appendChild(table);
}

// a row per model of every device, each followed by its LoRA adapters' rows (marked as its)
function drawModels(tbody, doc) {
  tbody.replaceChildren();
  const row = (cells, cls) => {
    const tr = document.createElement("tr");
    if (cls) tr.className = cls;
    for (const v of cells) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
    return tr;
  };
  for (const d of doc.devices) {
    const page = d.pool.page_bytes;
    for (const m of d.models) {
      const tr = row([m.name, d.device, m.residency, size(m.weight_pages * page),
        size(m.kv_bytes), m.num_running, m.num_waiting, m.requests_total, m.activations,
        m.evictions]);
      tr.dataset.model = m.name;
      for (const a of m.adapters || []) {
        const slot = a.slot === null ? "no slot" : `slot ${a.slot}`;
        const ar = row([`↳ ${a.name}`, `LoRA of ${m.name} · r${a.rank} · ${slot}`, a.residency,
          size(a.weight_pool_bytes), "–", a.num_running, a.num_waiting, a.requests_total,
          a.activations, a.evictions], "adapter");
        ar.dataset.model = a.name;
        ar.dataset.adapterOf = m.name;
        ar.title = `${a.name}: ${size(a.weight_bytes)} of weights, from ${a.path}`;
      }
    }
  }
}

function drawMoves(tbody, doc) {
  tbody.replaceChildren();
  for (const e of doc.events.filter((e) => e.kind === "move").slice(0, 12)) {
    const tr = document.createElement("tr");
    const cells = [`${(doc.time - e.time).toFixed(1)} s ago`, e.device, e.pages, e.giver,
      e.taker || "the pool", e.reason];
    for (const v of cells) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

async function poll() {
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  try {
    const r = await fetch("/v1/status", { headers, cache: "no-store" });
    if (!r.ok) throw new Error(`/v1/status answered ${r.status}`);
    const doc = await r.json();
    state.samples.push(sample(doc));
    while (state.samples.length > 2 && state.samples[0].time < doc.time - WINDOW_S - 5) {
      state.samples.shift();
    }
    const models = doc.devices.reduce((n, d) => n + d.models.length, 0);
    const adapters = doc.devices.reduce(
      (n, d) => n + d.models.reduce((k, m) => k + (m.adapters || []).length, 0), 0);
    document.getElementById("summary").textContent =
      `policy ${doc.policy} · ${doc.devices.length} device(s) · ${models} model(s)` +
      (adapters ? ` · ${adapters} adapter(s)` : "");
    document.getElementById("error").textContent = "";
    drawMemory(document.getElementById("memory"));
    drawRates(document.getElementById("rates"));
    drawResidency(document.getElementById("residency"));
    drawSlo(document.getElementById("slo"));
    drawModels(document.querySelector("#models tbody"), doc);
    drawMoves(document.querySelector("#moves tbody"), doc);
    state.polls = (state.polls || 0) + 1;
  } catch (e) {
    document.getElementById("error").textContent = String(e.message || e);
  }
}

state.key = keyFromHash();
poll();
setInterval(poll, POLL_MS);
