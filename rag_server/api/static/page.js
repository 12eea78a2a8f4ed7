// The picrag page: asks /rag/query (streamed server-sent events) and draws the server's live
// panels from /picrag/stats and /picrag/quality. Plain browser JavaScript, no build step; charts
// are SVG drawn here. The API key, when the server needs one, is kept in this browser's
// localStorage and sent as X-API-Key on every call.
"use strict";

const KEY_STORAGE = "picrag.apiKey";
const STATS_EVERY_MS = 2000;
const QUALITY_EVERY_MS = 5000;
const HIT_RATE_HISTORY = 60; // polls kept for the hit-rate chart
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = { reused: "#2f7d5b", computed: "#c9822b", p50: "#3559c7", p90: "#9aaee8", line: "#3559c7" };
// The runtime's picrag counters shown in the chunk store panel, in order, with their labels.
const STORE_COUNTERS = [
  ["compile_chunk_misses", "chunks compiled"],
  ["compile_chunk_hits", "compiles already cached"],
  ["chunk_hits", "chunk hits (linked requests)"],
  ["chunk_misses", "chunk misses (linked requests)"],
  ["reused_tokens", "prompt tokens reused"],
  ["computed_tokens", "prompt tokens computed"],
  ["disk_saves", "chunks saved to disk"],
  ["disk_loads", "chunks loaded from disk"],
  ["disk_evictions", "disk evictions"],
];

const $ = (id) => document.getElementById(id);
const hitRates = [];
let qualityOffered = true; // until /picrag/quality says otherwise

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers["X-API-Key"] = apiKey();
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    notice(apiKey() ? "The server refused this API key." : "This server needs an API key: enter it above.");
  }
  return response;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const detail = body.detail;
    if (Array.isArray(detail)) return detail.map((d) => d.msg || JSON.stringify(d)).join("; ");
    return typeof detail === "string" ? detail : JSON.stringify(body);
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// ---- the policy menu

async function loadPolicies() {
  const response = await api("/picrag/policies");
  if (!response.ok) return false;
  notice("");
  const menu = await response.json();
  const select = $("policy");
  const chosen = select.value;
  select.replaceChildren();
  const names = menu.policies.map((p) => p.name);
  if (!names.includes(menu.default)) {
    select.append(new Option(`${menu.default} (default)`, menu.default));
  }
  for (const policy of menu.policies) {
    const isDefault = policy.name === menu.default;
    const option = new Option(isDefault ? `${policy.name} (default)` : policy.name, policy.name);
    option.title = policy.available ? policy.summary : `unavailable: ${policy.reason}`;
    option.disabled = !policy.available;
    option.dataset.summary = option.title;
    select.append(option);
  }
  select.value = chosen && names.includes(chosen) ? chosen : menu.default;
  showPolicySummary();
  $("server-line").textContent = `default policy ${menu.default}`;
  return true;
}

function showPolicySummary() {
  const option = $("policy").selectedOptions[0];
  $("policy-summary").textContent = option ? option.dataset.summary || "" : "";
}

// ---- asking

function documents() {
  return $("documents").value.split(/\n\s*\n/).map((t) => t.trim()).filter((t) => t).map((text) => ({ text }));
}

async function ask(event) {
  event.preventDefault();
  const body = {
    question: $("question").value,
    policy: $("policy").value || undefined,
    max_tokens: Number($("max-tokens").value) || 64,
    stream: true,
  };
  const docs = documents();
  if (docs.length) body.documents = docs;
  $("ask").disabled = true;
  $("answer").textContent = "";
  $("answer").dataset.state = "streaming";
  for (const id of ["answer-facts", "reuse-bar", "answer-error"]) $(id).hidden = true;
  $("sources").replaceChildren();
  $("warnings").replaceChildren();
  try {
    const response = await api("/rag/query", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await errorText(response));
    let finished = false;
    for await (const message of events(response.body)) {
      if (message.type === "token") $("answer").textContent += message.text;
      else if (message.type === "done") { showAnswer(message); finished = true; }
      else if (message.type === "error") throw new Error(`${message.status}: ${message.message}`);
    }
    if (!finished) throw new Error("the answer stream ended early");
  } catch (err) {
    $("answer-error").textContent = String(err.message || err);
    $("answer-error").hidden = false;
    $("answer").dataset.state = "failed";
  } finally {
    $("ask").disabled = false;
    refreshStats();
  }
}

// Server-sent events from a fetch body: every `data:` line is one JSON object.
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (value) buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) yield JSON.parse(line.slice(5));
      }
    }
    if (done) return;
  }
}

function showAnswer(done) {
  $("answer").textContent = done.answer; // the stripped answer, as the JSON route gives it
  $("answer").dataset.state = "done";
  const usage = done.usage;
  $("answer-policy").textContent = done.policy_reason ? `${done.policy} (auto: ${done.policy_reason})` : done.policy;
  $("reused-tokens").textContent = usage.reused_tokens;
  $("computed-tokens").textContent = usage.computed_tokens;
  $("answer-ttft").textContent = `${ms(done.timings.ttft_ms)} ms`;
  $("answer-total").textContent = `${ms(done.timings.total_ms)} ms`;
  $("answer-facts").hidden = false;
  const prompt = usage.reused_tokens + usage.computed_tokens;
  if (prompt > 0) {
    const [reused, computed] = $("reuse-bar").children;
    reused.style.width = `${(100 * usage.reused_tokens) / prompt}%`;
    computed.style.width = `${(100 * usage.computed_tokens) / prompt}%`;
    $("reuse-bar").title = `${usage.reused_tokens} reused, ${usage.computed_tokens} computed`;
    $("reuse-bar").hidden = false;
  }
  for (const source of done.sources) {
    const item = document.createElement("li");
    const score = source.score == null ? "" : ` (score ${source.score.toFixed(3)})`;
    item.textContent = `${source.title || source.id}${score}`;
    $("sources").append(item);
  }
  for (const text of done.warnings) {
    const item = document.createElement("li");
    item.textContent = text;
    $("warnings").append(item);
  }
}

// ---- live panels

async function refreshStats() {
  const response = await api("/picrag/stats");
  if (!response.ok) return;
  const stats = await response.json();
  const policies = Object.entries(stats.policies);
  barChart($("requests-chart"), policies.map(([name, p]) => ({ label: name, values: [p.requests] })),
    [COLORS.p50], (v) => String(v));
  barChart($("ttft-chart"), policies.map(([name, p]) => ({ label: name, values: [p.ttft_p50_ms, p.ttft_p90_ms] })),
    [COLORS.p50, COLORS.p90], ms);
  $("ttft-p50").textContent = stats.ttft_p50_ms == null ? "-" : ms(stats.ttft_p50_ms);
  $("ttft-p90").textContent = stats.ttft_p90_ms == null ? "-" : ms(stats.ttft_p90_ms);
  lineChart($("ttft-recent"), stats.recent.map((r) => r.ttft_ms), "recent requests' TTFT, ms", ms);
  showCache(stats);
}

function showCache(stats) {
  const table = $("store-table");
  table.replaceChildren();
  if (!stats.cache) {
    $("hit-rate").textContent = "-";
    addRow(table, stats.cache_error, "");
    return;
  }
  const rate = stats.cache.chunk_hit_rate;
  $("hit-rate").textContent = rate == null ? "-" : percent(rate);
  $("hit-rate").dataset.value = rate == null ? "" : String(rate);
  if (rate != null) {
    hitRates.push(rate);
    if (hitRates.length > HIT_RATE_HISTORY) hitRates.shift();
  }
  lineChart($("hit-rate-chart"), hitRates, "hit rate since start, last polls", percent, 1);
  for (const [name, label] of STORE_COUNTERS) {
    const value = stats.cache.counters[name];
    if (value !== undefined) addRow(table, label, value.toLocaleString(), name);
  }
}

async function refreshQuality() {
  if (!qualityOffered) return;
  const response = await api("/picrag/quality");
  if (response.status === 404) {
    qualityOffered = false;
    $("quality-panel").hidden = true;
    return;
  }
  if (!response.ok) return;
  const quality = await response.json();
  const table = $("quality-table");
  table.replaceChildren();
  const rows = [];
  for (const [policy, buckets] of Object.entries(quality.policies || {})) {
    const recent = pooled(Object.values(buckets).map((b) => b.recent));
    const allTime = pooled(Object.values(buckets).map((b) => b.all_time));
    rows.push({ label: policy, values: [recent.mean_kl, allTime.mean_kl] });
    addRow(table, `${policy}: ${allTime.count} samples, agreement`,
      allTime.agreement_rate == null ? "-" : percent(allTime.agreement_rate), policy);
  }
  barChart($("quality-chart"), rows, [COLORS.p50, COLORS.p90], round, "no shadow samples yet");
  const cost = quality.shadow_cost;
  if (cost) addRow(table, "shadow cost", Object.entries(cost).map(([k, v]) => `${k} ${v}`).join(", "));
  $("quality-panel").hidden = false;
}

// One tally ({count, mean_kl, agreement_rate}) from the prompt-size buckets' own.
function pooled(tallies) {
  const count = tallies.reduce((n, t) => n + t.count, 0);
  const mean = (name) => (count ? tallies.reduce((s, t) => s + (t.count ? t[name] * t.count : 0), 0) / count : null);
  return { count, mean_kl: mean("mean_kl"), agreement_rate: mean("agreement_rate") };
}

function addRow(table, label, value, name) {
  const row = table.insertRow();
  row.insertCell().textContent = label;
  const cell = row.insertCell();
  cell.className = "n";
  cell.textContent = value;
  if (name) row.dataset.counter = name;
}

// ---- charts (SVG)

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Horizontal bars, one row per label, one bar per value (values null are left out).
function barChart(el, rows, colors, format, empty = "no requests yet") {
  const width = 480, labelWidth = 130, barHeight = 12, gap = 6;
  const rowHeight = barHeight * colors.length + gap;
  const max = Math.max(0, ...rows.flatMap((r) => r.values.filter((v) => v != null)));
  const chart = svg("svg", { viewBox: `0 0 ${width} ${Math.max(rows.length * rowHeight, 18)}`, role: "img" });
  if (!rows.length) chart.append(svg("text", { x: 0, y: 13 }, empty));
  rows.forEach((row, i) => {
    const group = svg("g", { "data-policy": row.label, "data-value": String(row.values[0]) });
    const top = i * rowHeight;
    group.append(svg("text", { x: 0, y: top + barHeight }, row.label));
    row.values.forEach((value, j) => {
      if (value == null) return;
      const length = max > 0 ? ((width - labelWidth - 50) * value) / max : 0;
      const y = top + j * barHeight;
      group.append(svg("rect", { x: labelWidth, y, width: Math.max(length, 1), height: barHeight - 2, fill: colors[j] }));
      group.append(svg("text", { x: labelWidth + length + 4, y: y + barHeight - 3 }, format(value)));
    });
    chart.append(group);
  });
  el.replaceChildren(chart);
}

// A line over `values` in order, with its caption and its largest value; `top`: the y-axis top
// (default: the largest value).
function lineChart(el, values, caption, format, top) {
  const width = 480, height = 50, pad = 14;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height + pad}`, role: "img" });
  const max = top || Math.max(...values, 0);
  if (values.length && max > 0) {
    const step = values.length > 1 ? width / (values.length - 1) : 0;
    const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - (height * v) / max + 2).toFixed(1)}`);
    chart.append(svg("polyline", { points: points.join(" "), fill: "none", stroke: COLORS.line, "stroke-width": 2 }));
  }
  chart.append(svg("text", { x: 0, y: height + pad - 2 }, caption));
  if (max > 0) chart.append(svg("text", { x: width, y: 10, "text-anchor": "end" }, `max ${format(max)}`));
  el.replaceChildren(chart);
}

const ms = (value) => (value == null ? "-" : String(Math.round(value)));
const percent = (value) => `${(100 * value).toFixed(1)}%`;
const round = (value) => (Math.abs(value) >= 100 ? value.toFixed(0) : value.toPrecision(3));

// ---- start

async function start() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    qualityOffered = true;
    refreshAll();
  });
  $("policy").addEventListener("change", showPolicySummary);
  $("ask-form").addEventListener("submit", ask);
  await refreshAll();
  setInterval(refreshStats, STATS_EVERY_MS);
  setInterval(refreshQuality, QUALITY_EVERY_MS);
}

async function refreshAll() {
  if (await loadPolicies()) await Promise.all([refreshStats(), refreshQuality()]);
}

start();
