// kvguard console: renders the guard's state (GET /state, then the stream GET /state/stream, one snapshot
// a second) and keeps the last HISTORY_S seconds of it here, in the page, for the sparklines and the
// one-minute service shares. The DOM is built with createElement/textContent only: nothing the guard sends
// is ever parsed as HTML, and the page's CSP forbids inline styles (sizes are set through the CSSOM).
"use strict";

const HISTORY_S = 300;      // what the sparklines show
const SHARE_WINDOW_S = 60;  // the service share's window
const SVG = "http://www.w3.org/2000/svg";

const history = new Map();  // series name -> [[time, value], ...], oldest first
const events = new Map();   // seq -> event, the feed as received (the stream sends each event once)
let lastTime = 0;

function track(name, time, value) {
  let points = history.get(name);
  if (!points) history.set(name, points = []);
  points.push([time, value]);
  while (points.length && points[0][0] < time - HISTORY_S) points.shift();
  return points;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

// An SVG sparkline of one or two series, drawn to [0, max] over the history the page has (at most the last
// HISTORY_S seconds: a page opened a moment ago draws its few seconds across the whole width).
function sparkline(width, height, series, max) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const top = Math.max(max || 0, ...series.flatMap((points) => points.map((p) => p[1])), 1e-9);
  const start = Math.min(lastTime - 1, ...series.filter((points) => points.length).map((points) => points[0][0]));
  series.forEach((points, i) => {
    if (points.length < 2) return;
    const x = (t) => ((t - start) / (lastTime - start)) * width;
    const y = (v) => height - 1 - (v / top) * (height - 2);
    const coords = points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    if (i === 0) {
      const area = document.createElementNS(SVG, "polygon");
      const [first, last] = [x(points[0][0]).toFixed(1), x(points.at(-1)[0]).toFixed(1)];
      area.setAttribute("points", `${first},${height} ${coords} ${last},${height}`);
      svg.append(area);
    }
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", coords);
    if (i > 0) line.setAttribute("class", "second");
    svg.append(line);
  });
  return svg;
}

function setSpark(id, series, max, width = 200, height = 32) {
  document.getElementById(id).replaceChildren(sparkline(width, height, series, max));
}

const pct = (x) => `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`;
const num = (x) => (x === undefined || x === null ? "–" : Number(x).toLocaleString("en-US"));

function badge(text, cls = text) {
  return el("span", { class: `badge ${cls}`, text });
}

function renderGuard(snap) {
  const g = snap.guard;
  const mode = document.getElementById("mode");
  mode.textContent = `${g.mode} for ${Math.round(g.mode_for_s)} s`;
  mode.className = `badge ${g.mode}`;
  document.getElementById("saturation").textContent = pct(g.saturation);
  document.getElementById("committed").textContent = `${num(g.committed_blocks)} / ${num(g.budget_blocks)}`;
  document.getElementById("queued").textContent = `${num(g.queued_requests)} (${num(g.queued_blocks)} blocks)`;
  const tokens = snap.replicas.reduce((sum, r) => sum + (r.engine.tokens_per_s || 0), 0);
  document.getElementById("tokens").textContent = num(Math.round(tokens));
  document.getElementById("jain").textContent = g.jain_index.toFixed(3);
  document.getElementById("policy").textContent = `routing: ${g.policy}; ${num(g.in_flight)} requests in flight`;
  setSpark("spark-saturation", [track("saturation", snap.time, g.saturation)], 1);
  setSpark("spark-committed", [track("committed", snap.time, g.committed_blocks)], g.budget_blocks);
  setSpark("spark-queued", [track("queued", snap.time, g.queued_requests)], 1);
  setSpark("spark-tokens", [track("tokens", snap.time, tokens)], 1);
}

function fact(label, value) {
  return el("span", {}, `${label} `, el("b", { text: value }));
}

function replicaCard(r, time) {
  const b = r.blocks;
  const total = b.total || 0;
  const pool = el("div", { class: "pool", title: "engine KV pool: used | cached | free" });
  if (total) {
    for (const part of ["used", "cached"]) {
      const seg = el("div", { class: part });
      seg.style.width = `${(100 * b[part]) / total}%`;
      pool.append(seg);
    }
    for (const [cls, value, what] of [["committed", b.reserved + b.outside, "committed by the guard"],
                                      ["budget", b.budget, "admission budget"]]) {
      const mark = el("div", { class: `mark ${cls}`, title: `${what}: ${value} blocks` });
      mark.style.left = `${Math.min(100, (100 * value) / total)}%`;
      pool.append(mark);
    }
  }
  const age = r.telemetry_age_s === null ? "none" : `${r.telemetry_age_s.toFixed(1)} s`;
  const e = r.engine;
  const spark = el("div", { class: "spark" });
  spark.append(sparkline(280, 32, [track(`replica:${r.name}:used`, time, b.used || 0),
                                   track(`replica:${r.name}:reserved`, time, b.reserved)], total));
  return el("div", { class: "card", "data-replica": r.name },
    el("h3", {}, r.name, badge(r.up ? "up" : "down"), badge(`circuit ${r.circuit}`, r.circuit)),
    pool,
    el("div", { class: "legend" },
      el("span", {}, el("span", { class: "swatch used-swatch" }), "used"),
      el("span", {}, el("span", { class: "swatch cached-swatch" }), "cached"),
      el("span", {}, el("span", { class: "swatch free-swatch" }), "free"),
      el("span", {}, el("span", { class: "swatch reserved-swatch" }), "committed")),
    el("div", { class: "facts" },
      fact("total", num(b.total)), fact("used", num(b.used)), fact("cached", num(b.cached)),
      fact("free", num(b.free)), fact("reserved", num(b.reserved)), fact("budget", num(b.budget))),
    el("div", { class: "facts" },
      fact("running", num(e.running)), fact("waiting", num(e.waiting)), fact("guard in flight", num(r.in_flight)),
      fact("tok/s", num(e.tokens_per_s)), fact("preemptions", num(e.preemptions_total)), fact("telemetry", age)),
    spark);
}

function renderReplicas(snap) {
  document.getElementById("replicas").replaceChildren(...snap.replicas.map((r) => replicaCard(r, snap.time)));
  const fallbacks = snap.fallbacks.map((f) => (f.kind === "engine" ? `${f.name} (engine, circuit ${f.circuit})`
                                                                    : `${f.name} (static message)`));
  document.getElementById("fallbacks").textContent =
    fallbacks.length ? `Fallbacks, in order: ${fallbacks.join(", ")}` : "No fallbacks.";
}

// The tenant's part of all service in the last SHARE_WINDOW_S, from the cumulative totals kept here;
// the share since the guard started until the page has seen a minute of service.
function recentShare(snap, tenant) {
  const delta = (name) => {
    const points = (history.get(`tenant:${name}:service`) || []).filter((p) => p[0] >= snap.time - SHARE_WINDOW_S);
    return points.length > 1 ? points.at(-1)[1] - points[0][1] : 0;
  };
  const total = snap.tenants.reduce((sum, t) => sum + delta(t.name), 0);
  return total > 0 ? [delta(tenant.name) / total, "last minute"] : [tenant.service_share, "since start"];
}

function limitCell(limits, kind) {
  const l = limits[kind];
  return el("td", { class: "num", text: l ? `${num(l.remaining)} / ${num(l.limit)}` : "no limit" });
}

function tenantRow(snap, t) {
  const [share, over] = recentShare(snap, t);
  const title = `service ${pct(share)} (${over}) vs weight ${pct(t.weight_share)}`;
  const shareCell = el("div", { class: "share", title });
  for (const [cls, value] of [["bar", share], ["bar weight", t.weight_share]]) {
    const bar = el("div", { class: cls });
    bar.style.width = `${Math.min(100, 100 * value)}%`;
    shareCell.append(bar);
  }
  const d = t.detector;
  const meter = el("span", { class: "meter", title: `suspicion ${d.suspicion.toFixed(2)}` }, el("span"));
  meter.firstChild.style.width = `${100 * d.suspicion}%`;
  const spark = el("div", { class: "spark" });
  spark.append(sparkline(120, 22, [track(`tenant:${t.name}:reserved`, snap.time, t.reserved_blocks),
                                   track(`tenant:${t.name}:queue`, snap.time, t.queue_depth)], 1));
  return el("tr", { class: t.retired ? "retired" : "", "data-tenant": t.name },
    el("td", {}, el("b", { text: t.name }), t.retired ? " (removed)" : ""),
    el("td", { text: t.lane || "–" }),
    el("td", { class: "num", text: num(t.queue_depth) }),
    el("td", { class: "num", text: num(t.running) }),
    el("td", { class: "num", text: num(t.reserved_blocks) }),
    el("td", {}, spark),
    el("td", {}, shareCell, el("span", { class: "note", text: `${pct(share)} vs ${pct(t.weight_share)}` })),
    limitCell(t.limits, "requests"), limitCell(t.limits, "tokens"),
    el("td", {}, badge(d.state), meter, el("span", { class: "note", text: ` ${d.suspicion.toFixed(2)}` })));
}

function describe(e) {
  switch (e.kind) {
    case "mode": return `mode ${e.was} → ${e.now} (saturation ${pct(e.saturation)})`;
    case "detection": return `tenant ${e.tenant} is now ${e.state}`;
    case "reload":
      return e.result === "ok" ? `configuration reloaded (hash ${e.hash}): tenants ${e.tenants.join(", ")}`
                               : "configuration reload refused; the running one stays (see the guard's log)";
    case "replica": return `replica ${e.subject} ${e.state} (was ${e.was})`;
    case "fallback": return `fallback ${e.subject}: circuit ${e.state}`;
    default: {
      const { seq, time, kind, ...fields } = e;
      return JSON.stringify(fields);
    }
  }
}

function renderEvents(snap) {
  for (const e of snap.events) events.set(e.seq, e);
  const newest = [...events.values()].sort((a, b) => b.seq - a.seq).slice(0, 200);
  events.clear();
  for (const e of newest) events.set(e.seq, e);
  document.getElementById("events").replaceChildren(...newest.map((e) => el("li", { "data-kind": e.kind },
    el("time", { text: new Date(e.time * 1000).toLocaleTimeString("en-GB") }),
    el("span", { class: "kind", text: e.kind }),
    el("span", { text: describe(e) }))));
}

// Recent requests (GET /requests): refreshed with each snapshot; a click shows the request's whole
// decision record (GET /requests/{id}) as JSON text.
let selected = null;

function requestRow(r) {
  const row = el("tr", { "data-request": r.request_id },
    el("td", { text: r.request_id }), el("td", { text: r.tenant ?? "–" }), el("td", { text: r.lane ?? "–" }),
    el("td", { text: r.priority_class ?? "–" }), el("td", { text: r.objective ?? "–" }),
    el("td", { class: "num", text: String(r.status ?? "–") }), el("td", { text: r.outcome }),
    el("td", { text: r.replica ?? "–" }), el("td", { class: "num", text: r.ttft_ms == null ? "–" : r.ttft_ms.toFixed(1) }));
  if (r.request_id === selected) row.classList.add("selected");
  row.addEventListener("click", () => showRecord(r.request_id));
  return row;
}

function batchRow(b) {
  return el("tr", { "data-batch": b.id },
    el("td", { text: b.id }), el("td", { text: b.tenant }), el("td", { text: b.endpoint }),
    el("td", { text: b.status }), el("td", { class: "num", text: String(b.total) }),
    el("td", { class: "num", text: String(b.pending) }));
}

function showRecord(id) {
  selected = id;
  fetch(`/requests/${encodeURIComponent(id)}`).then((response) => response.json()).then((record) => {
    const box = document.getElementById("record");
    box.textContent = JSON.stringify(record, null, 2);
    box.hidden = false;
    box.dataset.request = id;
  }).catch(() => {});
}

function renderRequests() {
  fetch("/requests?limit=20").then((response) => response.json()).then((body) => {
    document.querySelector("#requests tbody").replaceChildren(...body.requests.map(requestRow));
  }).catch(() => {});
}

function render(snap) {
  if (snap.guard.event_seq < Math.max(0, ...events.keys())) events.clear();  // the guard restarted
  lastTime = snap.time;
  renderGuard(snap);
  renderReplicas(snap);
  for (const t of snap.tenants) track(`tenant:${t.name}:service`, snap.time, t.service);  // before any share
  document.querySelector("#tenants tbody").replaceChildren(...snap.tenants.map((t) => tenantRow(snap, t)));
  document.querySelector("#batches tbody").replaceChildren(...(snap.batches ?? []).map(batchRow));
  renderEvents(snap);
  renderRequests();
  document.body.dataset.updated = String(snap.time);  // when the page last heard from the guard
}

function connect() {
  const status = document.getElementById("connection");
  const stream = new EventSource("/state/stream");
  stream.onopen = () => { status.textContent = "live"; status.className = "connection live"; };
  stream.onmessage = (message) => render(JSON.parse(message.data));
  stream.onerror = () => { status.textContent = "reconnecting…"; status.className = "connection lost"; };
}

fetch("/state").then((response) => response.json()).then(render).catch(() => {}).finally(connect);
