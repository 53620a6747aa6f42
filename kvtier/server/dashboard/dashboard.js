// kvtier dashboard: polls the server's /status (cumulative counters) and draws rates from the
// difference of two polls, so the server keeps no samples. Plain DOM and SVG, no libraries.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.min(60000, Math.max(250, Number(params.get("interval") || 2) * 1000));
const KEEP = 300; // samples in the ring buffer: 10 minutes at the default interval
const TIER_COLORS = ["#3b6fd8", "#d97706", "#8b5cf6", "#db2777", "#0891b2"];
const SVG_NS = "http://www.w3.org/2000/svg";

const samples = [];
let polls = 0;
let failingSince = null;

// -- formatting --------------------------------------------------------------------------------

const fmtInt = (n) => Math.round(n).toLocaleString("en-US");
const fmtPct = (r) => (r === null || !isFinite(r) ? "–" : (100 * r).toFixed(1) + "%");
const fmtRate = (v) => (v === null ? "–" : v >= 100 ? fmtInt(v) : v.toFixed(1));

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? String(n) : n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2)) + " " + units[i];
}

function fmtDuration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d) return `${d} d ${h} h`;
  if (h) return `${h} h ${m} min`;
  if (m) return `${m} min ${s % 60} s`;
  return `${s} s`;
}

const sum = (xs) => xs.reduce((a, b) => a + b, 0);

// -- DOM helpers -------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

/** Show ``value`` in every element bound to ``name``; the raw value goes to data-value, so that
 * a reader (or a test) need not parse the formatted text. */
function setField(name, value, text = typeof value === "number" ? fmtInt(value) : String(value)) {
  for (const node of document.querySelectorAll(`[data-field="${name}"]`)) {
    node.textContent = text;
    node.dataset.value = value === null ? "" : String(value);
    if (node.hasAttribute("data-warn")) node.classList.toggle("alert", value > 0);
  }
}

// -- one poll ----------------------------------------------------------------------------------

function sampleOf(s) {
  const t = s.traffic;
  const usage = {};
  for (const tier of s.tiers) usage[tier.name] = tier.capacity_bytes ? tier.used_bytes / tier.capacity_bytes : null;
  return {
    t: s.uptime_s,
    requested: t.requested_tokens,
    hit: { ...t.hit_tokens },
    hitTotal: sum(Object.values(t.hit_tokens)),
    evictions: sum(s.tiers.map((tier) => tier.stats.evictions)),
    dropped: s.store.dropped_writes,
    usage,
  };
}

function renderTotals(s) {
  const t = s.traffic;
  const hit = sum(Object.values(t.hit_tokens));
  setField("version", s.version, "v" + s.version);
  setField("uptime", s.uptime_s, fmtDuration(s.uptime_s));
  setField("shared_memory", s.shared_memory, s.shared_memory ? "on" : "off");
  setField("hit_rate", t.requested_tokens ? hit / t.requested_tokens : null, fmtPct(t.requested_tokens ? hit / t.requested_tokens : null));
  document.getElementById("hit-rate-tiers").textContent = Object.entries(t.hit_tokens)
    .map(([name, n]) => `${name} ${fmtPct(t.requested_tokens ? n / t.requested_tokens : null)}`)
    .join(" · ");
  setField("traffic.hit_tokens", hit);
  setField("traffic.requested_tokens", t.requested_tokens);
  setField("computed_tokens", t.requested_tokens - hit);
  setField("traffic.lookups", t.lookups);
  setField("traffic.stored_tokens", t.stored_tokens);
  setField("traffic.retrieve_requests", t.retrieve_requests);
  setField("traffic.retrieved_bytes", t.retrieved_bytes, fmtBytes(t.retrieved_bytes));
  setField("evictions", sum(s.tiers.map((tier) => tier.stats.evictions)));
  setField("store.promotions", s.store.promotions);
  setField("store.dropped_writes", s.store.dropped_writes);
  setField("store.failed_writes", s.store.failed_writes);
  setField("corrupt", sum(s.tiers.map((tier) => tier.stats.corrupt)));
  setField("tier_errors", sum(s.tiers.map((tier) => tier.stats.errors)));
  setField("connected_clients", s.connected_clients ?? 0);
  setField("leases_and_reservations", s.leases_and_reservations);
}

function renderTiers(s) {
  const body = document.querySelector("#tiers tbody");
  body.replaceChildren();
  const cell = (name, field, value, warn = false) =>
    el("td", { "data-field": `tiers.${name}.${field}`, "data-value": String(value), class: warn && value > 0 ? "alert" : "" }, fmtInt(value));
  for (const tier of s.tiers) {
    const row = el("tr", { "data-tier": tier.name }, el("td", {}, tier.name));
    if (tier.error) {
      row.append(el("td", { class: "usage", colSpan: 9 }, `unavailable (${tier.error})`));
      body.append(row);
      continue;
    }
    const share = tier.capacity_bytes ? tier.used_bytes / tier.capacity_bytes : 0;
    const fill = el("div", { class: share > 0.9 ? "high" : "" });
    fill.style.width = `${Math.min(100, 100 * share).toFixed(2)}%`;
    row.append(
      el("td", { class: "usage", "data-field": `tiers.${tier.name}.used_bytes`, "data-value": String(tier.used_bytes) },
        el("div", { class: "bar" }, fill),
        el("small", {}, `${fmtBytes(tier.used_bytes)} of ${fmtBytes(tier.capacity_bytes)} (${fmtPct(share)})`)),
      cell(tier.name, "objects", tier.objects),
      cell(tier.name, "hit_tokens", s.traffic.hit_tokens[tier.name] ?? 0),
      cell(tier.name, "hits", tier.stats.hits),
      cell(tier.name, "misses", tier.stats.misses),
      cell(tier.name, "evictions", tier.stats.evictions),
      cell(tier.name, "rejected_puts", tier.stats.rejected_puts, true),
      cell(tier.name, "corrupt", tier.stats.corrupt, true),
      cell(tier.name, "errors", tier.stats.errors, true),
    );
    body.append(row);
  }
}

function renderRequests(s) {
  const rows = [];
  for (const [op, n] of Object.entries(s.traffic.requests).sort()) rows.push([op, `requests.${op}`, n]);
  for (const [code, n] of Object.entries(s.traffic.client_errors).sort()) rows.push([`error: ${code}`, `client_errors.${code}`, n]);
  for (const [kind, n] of Object.entries(s.traffic.expired).sort()) rows.push([`expired ${kind}s`, `expired.${kind}`, n]);
  if (!rows.length) rows.push(["no requests yet", "none", 0]);
  document.querySelector("#requests tbody").replaceChildren(
    ...rows.map(([label, field, n]) =>
      el("tr", {}, el("td", {}, label), el("td", { "data-field": field, "data-value": String(n) }, fmtInt(n)))),
  );
}

function flatten(value, prefix, out) {
  if (Array.isArray(value)) {
    if (!value.length) out.push([prefix, "[]"]);
    value.forEach((v, i) => flatten(v, `${prefix}[${i}]`, out));
  } else if (value !== null && typeof value === "object") {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else {
    out.push([prefix, value === "" ? "(none)" : String(value)]);
  }
  return out;
}

let configShown = "";
function renderConfig(s) {
  const config = s.config || {};
  const key = JSON.stringify(config);
  if (key === configShown) return; // keep a selection in place while nothing changed
  configShown = key;
  document.querySelector("#config tbody").replaceChildren(
    ...flatten(config, "", []).map(([k, v]) =>
      el("tr", {}, el("td", {}, k), el("td", { "data-field": `config.${k}` }, v))),
  );
}

// -- charts ------------------------------------------------------------------------------------

const W = 640, H = 200, M = { left: 52, right: 12, top: 10, bottom: 24 };

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function timeTicks(x0, x1) {
  const span = x1 - x0;
  const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600].find((s) => span / s <= 6) || 3600;
  const ticks = [];
  for (let back = 0; back <= span + 1e-9; back += step) ticks.push(x1 - back);
  return { ticks, label: (t) => (t === x1 ? "now" : step >= 60 ? `−${Math.round((x1 - t) / 60)} min` : `−${Math.round(x1 - t)} s`) };
}

/** A line chart (or stacked areas) of ``series`` sharing ``xs``; null values leave gaps. */
function drawChart(id, { xs, series, yMax, yFormat, stacked = false, empty }) {
  const root = document.getElementById(id);
  root.replaceChildren();
  const pw = W - M.left - M.right, ph = H - M.top - M.bottom;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length - 1] : 1;
  const sx = (t) => M.left + (x1 > x0 ? ((t - x0) / (x1 - x0)) * pw : pw);
  const sy = (v) => M.top + ph - (Math.min(v, yMax) / yMax) * ph;
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    root.append(svg("line", { class: "grid", x1: M.left, x2: W - M.right, y1: sy(v), y2: sy(v) }));
    root.append(svg("text", { class: "axis-label", x: M.left - 6, y: sy(v) + 4, "text-anchor": "end" }, yFormat(v)));
  }
  if (xs.length < 2) {
    root.append(svg("text", { class: "empty", x: M.left + pw / 2, y: M.top + ph / 2, "text-anchor": "middle" },
      "collecting: rates need two polls"));
    return;
  }
  const { ticks, label } = timeTicks(x0, x1);
  for (const t of ticks) {
    root.append(svg("text", { class: "axis-label", x: sx(t), y: H - 6, "text-anchor": t === x1 ? "end" : "middle" }, label(t)));
  }
  const base = xs.map(() => 0);
  let anyValue = false;
  for (const s of series) {
    const top = s.values.map((v, i) => (v === null ? null : base[i] + v));
    let line = "", area = [];
    const flushArea = () => {
      if (stacked && area.length > 1) {
        const pts = area.map(([i, v]) => `${sx(xs[i])},${sy(v)}`).concat(area.slice().reverse().map(([i]) => `${sx(xs[i])},${sy(base[i])}`));
        root.append(svg("polygon", { class: "area", fill: s.color, points: pts.join(" ") }));
      }
      area = [];
    };
    top.forEach((v, i) => {
      if (v === null) { flushArea(); return; }
      anyValue = true;
      const prev = i > 0 && top[i - 1] !== null;
      line += `${prev ? "L" : "M"}${sx(xs[i]).toFixed(1)},${sy(v).toFixed(1)}`;
      area.push([i, v]);
    });
    flushArea();
    if (line) root.append(svg("path", { class: "series", stroke: s.color, d: line }));
    // isolated points (a value between two gaps) would draw nothing: mark them
    top.forEach((v, i) => {
      if (v !== null && (i === 0 || top[i - 1] === null) && (i === top.length - 1 || top[i + 1] === null)) {
        root.append(svg("circle", { cx: sx(xs[i]), cy: sy(v), r: 2.5, fill: s.color }));
      }
    });
    if (stacked) top.forEach((v, i) => { if (v !== null) base[i] = v; });
  }
  if (!anyValue && empty) {
    root.append(svg("text", { class: "empty", x: M.left + pw / 2, y: M.top + ph / 2, "text-anchor": "middle" }, empty));
  }
}

function drawLegend(id, series, format) {
  document.getElementById(id).replaceChildren(
    ...series.map((s) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = s.color;
      const last = [...s.values].reverse().find((v) => v !== null);
      return el("span", {}, swatch, s.name, el("span", { class: "now" }, last === undefined ? "" : format(last)));
    }),
  );
}

function renderCharts() {
  // Rates between consecutive polls, placed at the later poll.
  const xs = [], perTier = {}, overall = [], cache = [], computed = [], evictions = [], dropped = [];
  const tierNames = samples.length ? Object.keys(samples[samples.length - 1].usage) : [];
  for (const name of tierNames) perTier[name] = [];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1], b = samples[i], dt = b.t - a.t;
    if (dt <= 0) continue;
    const requested = b.requested - a.requested, hit = b.hitTotal - a.hitTotal;
    xs.push(b.t);
    overall.push(requested > 0 ? hit / requested : null);
    for (const name of tierNames) perTier[name].push(requested > 0 ? ((b.hit[name] || 0) - (a.hit[name] || 0)) / requested : null);
    cache.push(hit / dt);
    computed.push((requested - hit) / dt);
    evictions.push((b.evictions - a.evictions) / dt);
    dropped.push((b.dropped - a.dropped) / dt);
  }
  const color = (i) => TIER_COLORS[i % TIER_COLORS.length];
  const pct = (v) => `${Math.round(100 * v)}%`;

  const hitSeries = [{ name: "all tiers", color: "#1d2330", values: overall },
    ...tierNames.map((name, i) => ({ name, color: color(i), values: perTier[name] }))];
  drawChart("chart-hit-rate", { xs, series: hitSeries, yMax: 1, yFormat: pct, empty: "no lookups in this window" });
  drawLegend("legend-hit-rate", hitSeries, fmtPct);

  const tokenSeries = [{ name: "from cache", color: "#0f8a5f", values: cache },
    { name: "computed", color: "#9aa3b2", values: computed }];
  const tokenMax = niceMax(Math.max(0, ...cache.map((v, i) => v + computed[i])));
  drawChart("chart-tokens", { xs, series: tokenSeries, yMax: tokenMax, yFormat: fmtRate, stacked: true });
  drawLegend("legend-tokens", tokenSeries, (v) => `${fmtRate(v)}/s`);

  const usageXs = samples.map((s) => s.t);
  const usageSeries = tierNames.map((name, i) => ({ name, color: color(i), values: samples.map((s) => s.usage[name] ?? null) }));
  drawChart("chart-usage", { xs: usageXs, series: usageSeries, yMax: 1, yFormat: pct });
  drawLegend("legend-usage", usageSeries, fmtPct);

  const pressureSeries = [{ name: "evictions", color: "#dc2626", values: evictions },
    { name: "dropped writes", color: "#d97706", values: dropped }];
  const pressureMax = niceMax(Math.max(0, ...evictions, ...dropped));
  drawChart("chart-pressure", { xs, series: pressureSeries, yMax: pressureMax, yFormat: fmtRate });
  drawLegend("legend-pressure", pressureSeries, (v) => `${fmtRate(v)}/s`);
}

// -- polling -----------------------------------------------------------------------------------

function setLive(state, text) {
  const live = document.getElementById("live");
  live.dataset.state = state;
  document.getElementById("live-text").textContent = text;
}

async function poll() {
  try {
    const response = await fetch("status", { cache: "no-store", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    const s = await response.json();
    const sample = sampleOf(s);
    if (samples.length && sample.t < samples[samples.length - 1].t) samples.length = 0; // the server restarted
    samples.push(sample);
    if (samples.length > KEEP) samples.splice(0, samples.length - KEEP);
    renderTotals(s);
    renderTiers(s);
    renderRequests(s);
    renderConfig(s);
    renderCharts();
    failingSince = null;
    polls += 1;
    document.body.dataset.polls = String(polls);
    setLive("ok", `live · ${new Date().toLocaleTimeString("en-GB")}`);
  } catch (err) {
    failingSince = failingSince || new Date();
    setLive("error", `no answer since ${failingSince.toLocaleTimeString("en-GB")} (${err.message}); retrying`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function clearCache(event) {
  event.preventDefault();
  const result = document.getElementById("clear-result");
  if (!window.confirm("Remove every cached object from every tier?")) return;
  const headers = {};
  const token = document.getElementById("token").value.trim();
  if (token) headers.Authorization = `Bearer ${token}`;
  result.className = "";
  try {
    const response = await fetch("clear-cache", { method: "POST", headers });
    const body = await response.json().catch(() => ({}));
    if (response.status === 401) throw new Error(token ? "the admin token is wrong" : "the admin token is required");
    if (!response.ok) throw new Error(`${response.status} ${body.detail || response.statusText}`);
    result.textContent = `Cleared: ${fmtInt(body.removed)} objects removed.`;
  } catch (err) {
    result.className = "error";
    result.textContent = `Not cleared: ${err.message}.`;
  }
}

document.getElementById("interval").textContent = `${POLL_MS / 1000} s`;
document.getElementById("clear-form").addEventListener("submit", clearCache);
for (const id of ["chart-hit-rate", "chart-tokens", "chart-usage", "chart-pressure"]) drawChart(id, { xs: [], series: [], yMax: 1, yFormat: () => "" });
poll();
