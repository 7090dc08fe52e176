// Packs per device over time: which trials trained together, when and for how long
// (bar height split by fusion key), and each pack's estimated and peak memory against
// the device's capacity (the strip under each lane).

import { FINISHED, serverNow } from "./api.js";
import { fusionLabels, memoryScale, packLanes, packSummary } from "./packs.js";
import {
  axisBottom, fmtBytes, fmtNum, fmtSeconds, h, hideTip, linearTicks, niceDomain, scale,
  showTip, svg,
} from "./svg.js";

const LABEL = 190;
// how an array's stack ran, as the tooltip says it
const MODES = { bmm: "hand-fused", vmap: "vmap", serial: "one at a time" };
const BAR = 30;
const MEM = 34;
const GAP = 18;
const AXIS = 30;
const RIGHT = 28; // room for the last tick label
const PALETTE = ["#2563eb", "#0d9488", "#9333ea", "#ea580c", "#0891b2", "#65a30d", "#db2777",
  "#4f46e5", "#ca8a04", "#475569"];

export class TimelinePanel {
  constructor(link) {
    this.link = link;
    this.groups = new Map(); // pack id -> <g>
    this.frameKey = null;
    this.span = 0;
    this.stats = h("div", { class: "stats" });
    this.chart = h("div", { class: "chart" });
    this.keys = h("div", { class: "legend" });
    this.root = h("div", {}, this.stats, this.chart, this.keys);
  }

  update(feed, ch) {
    this.feed = feed;
    if (!feed?.summary) return;
    const packs = [...feed.packs.values()];
    this.stats.replaceChildren(...packSummary(packs, feed).map((t) => h("span", {}, t)));
    const started = packs.filter((p) => p.started_at);
    if (started.length === 0) {
      this.chart.replaceChildren(h("p", { class: "placeholder" }, "No pack has started yet."));
      this.frameKey = null;
      return;
    }
    const frame = this.frameFor(feed, started);
    const key = JSON.stringify([frame.width, this.span, frame.lanes.map((l) => [l.name, l.mem])]);
    if (key !== this.frameKey || ch === null) {
      this.frameKey = key;
      this.draw(frame, started);
    } else {
      for (const p of started) {
        if (ch.packs.has(p.id) || !p.finished_at) this.drawPack(p);
      }
      this.drawNow();
    }
  }

  frameFor(feed, started) {
    const width = Math.max(420, this.chart.clientWidth || 900);
    const s = feed.summary;
    this.t0 = Math.min(...started.map((p) => Date.parse(p.started_at)),
      s.started_at ? Date.parse(s.started_at) : Infinity);
    const running = !FINISHED.has(s.status);
    this.now = running ? serverNow() : null;
    const ends = started.map((p) => Date.parse(p.finished_at ?? p.started_at));
    const last = Math.max(...ends, this.now ?? 0, s.finished_at ? Date.parse(s.finished_at) : 0);
    const needed = Math.max(1, (last - this.t0) / 1000);
    if (!running) this.span = niceDomain("linear", 0, needed)[1];
    else if (needed > this.span) this.span = niceDomain("linear", 0, needed * 1.3)[1];
    this.colors = new Map();
    this.labels = fusionLabels(feed);
    [...this.labels.keys()].forEach((k, i) => this.colors.set(k, PALETTE[i % PALETTE.length]));
    const lanes = packLanes(started, feed.workers).map((lane) => ({
      ...lane,
      mem: memoryScale(lane),
    }));
    return { width, lanes };
  }

  draw(frame, started) {
    const { width, lanes } = frame;
    const laneH = BAR + MEM + GAP;
    const height = lanes.length * laneH + AXIS;
    this.x = scale("linear", [0, this.span], [LABEL, width - RIGHT]);
    const root = svg("svg", { width, height, class: "timeline" });
    axisBottom(root, this.x, height - AXIS + 4, linearTicks(0, this.span, 8), clock,
      height - AXIS + 4);
    this.lanes = new Map();
    lanes.forEach((lane, i) => {
      const top = i * laneH + 4;
      const g = svg("g", { class: "lane", "data-lane": lane.name }, root);
      svg("rect", { class: "lane-bg", x: LABEL, y: top, width: width - LABEL - RIGHT, height: BAR }, g);
      label(g, lane, top);
      const memTop = top + BAR + 4;
      const memG = svg("g", { class: "mem" }, g);
      svg("line", { class: "mem-base", x1: LABEL, x2: width - RIGHT, y1: memTop + MEM - 4, y2: memTop + MEM - 4 }, memG);
      if (lane.mem.capacityOnScale) {
        svg("line", { class: "capacity", x1: LABEL, x2: width - RIGHT, y1: memTop, y2: memTop }, memG);
      }
      this.lanes.set(lane.name, { g: svg("g", {}, g), top, memTop, mem: lane.mem, lane });
    });
    this.nowLine = svg("line", { class: "now", y1: 0, y2: height - AXIS + 4 }, root);
    this.svg = root;
    this.groups.clear();
    for (const p of started) this.drawPack(p);
    this.drawNow();
    root.addEventListener("mouseover", (e) => this.hover(e));
    root.addEventListener("mousemove", (e) => this.hover(e));
    root.addEventListener("mouseleave", () => this.link.hover([]));
    this.chart.replaceChildren(root);
    this.keys.replaceChildren(
      ...[...this.labels].map(([key, text]) =>
        h("span", {}, h("i", { class: "swatch", style: `background:${this.colors.get(key)}` }), text)),
      h("span", {}, h("i", { class: "swatch est" }), "estimated memory"),
      h("span", {}, h("i", { class: "swatch peak" }), "measured peak"),
      h("span", {}, h("i", { class: "swatch failed" }), "failed / split (out of memory)"));
  }

  drawNow() {
    if (!this.nowLine) return;
    const now = FINISHED.has(this.feed.summary.status) ? null : serverNow();
    this.nowLine.style.display = now ? "" : "none";
    if (now) {
      const x = this.x(Math.min(this.span, (now - this.t0) / 1000));
      this.nowLine.setAttribute("x1", x);
      this.nowLine.setAttribute("x2", x);
    }
  }

  drawPack(p) {
    const laneName = p.device ?? p.worker ?? "unassigned";
    const lane = this.lanes.get(laneName);
    if (!lane) return;
    this.groups.get(p.id)?.remove();
    const start = (Date.parse(p.started_at) - this.t0) / 1000;
    const end = p.finished_at ? (Date.parse(p.finished_at) - this.t0) / 1000 : (serverNow() - this.t0) / 1000;
    const x0 = this.x(start);
    const w = Math.max(2, this.x(Math.min(this.span, Math.max(end, start))) - x0);
    const g = svg("g", { class: `pack s-${p.status}`, "data-pack": p.id }, lane.g);
    const counts = new Map();
    for (const m of p.members) counts.set(m.fusion_key, (counts.get(m.fusion_key) ?? 0) + 1);
    let y = lane.top;
    const k = p.members.length;
    for (const [key, n] of [...counts].sort()) {
      const hgt = (BAR * n) / k;
      svg("rect", { x: x0, y, width: w, height: hgt, fill: this.colors.get(key) ?? "#64748b", class: "stripe" }, g);
      y += hgt;
    }
    if (k > 1 && k <= 16 && w > 6) {
      let d = "";
      for (let i = 1; i < k; i++) d += `M${x0},${lane.top + (BAR * i) / k}h${w}`;
      svg("path", { d, class: "sep" }, g);
    }
    svg("rect", { x: x0, y: lane.top, width: w, height: BAR, class: "outline" }, g);
    if (w >= 24) {
      svg("text", { x: x0 + w / 2, y: lane.top + BAR / 2 + 4, "text-anchor": "middle", class: "k" }, g)
        .textContent = `×${k}`;
    }
    const { memTop, mem } = lane;
    const base = memTop + MEM - 4;
    const hOf = (b) => Math.min(MEM - 4, ((MEM - 4) * b) / mem.top);
    if (p.estimated_bytes) {
      const hh = Math.max(1, hOf(p.estimated_bytes));
      svg("rect", { x: x0, y: base - hh, width: w, height: hh, class: "mem-est" }, g);
    }
    if (p.peak_bytes) {
      const hh = Math.max(1, hOf(p.peak_bytes));
      svg("rect", { x: x0 + w * 0.2, y: base - hh, width: Math.max(1, w * 0.6), height: hh, class: "mem-peak" }, g);
    }
    this.groups.set(p.id, g);
  }

  hover(event) {
    const g = event.target.closest?.("g.pack");
    if (!g) {
      hideTip();
      return;
    }
    const p = this.feed.packs.get(Number(g.dataset.pack));
    if (!p) return;
    const lane = this.lanes.get(p.device ?? p.worker ?? "unassigned")?.lane;
    const ranges = new Map();
    for (const m of p.members) {
      const r = `${fmtNum(m.from_resource)}→${fmtNum(m.to_resource)}`;
      const part = m.segment == null ? "" : ` segment ${m.segment}`;  // a segment unit
      ranges.set(r, [...(ranges.get(r) ?? []), `#${m.trial_id}${part}`]);
    }
    const took = p.duration ?? (serverNow() - Date.parse(p.started_at)) / 1000;
    const failed = p.failed_trials ?? [];
    const how = (p.arrays ?? []).map((a) => {
      const stacks = a.stacks.map(
        (st) => `${MODES[st.mode] ?? st.mode}${st.compiled ? " compiled" : ""} ×${st.trials.length}`);
      const notes = a.notes.length ? ` (${a.notes.join("; ").slice(0, 160)})` : "";
      const part = a.segment == null ? "" : ` (segment ${a.segment})`;
      return `array ${a.trials.map((t) => `#${t}`).join(" ")}${part}: ${stacks.join(", ") || "did not run"}${notes}`;
    });
    showTip(event,
      h("b", {}, `pack ${p.id} · ${p.status}`,
        failed.length ? ` · ${failed.length} trial${failed.length > 1 ? "s" : ""} failed` : "",
        p.attempts > 1 ? ` · attempt ${p.attempts}` : ""),
      `${p.members.length} ${p.members.some((m) => m.segment != null) ? "unit" : "trial"}` +
        `${p.members.length > 1 ? "s" : ""} trained together on ${p.device ?? "?"}`,
      ...[...ranges].map(([r, ids]) => `${r}: ${ids.join(" ")}`),
      `${p.finished_at ? "took" : "running for"} ${fmtSeconds(took)}` +
        (p.train_seconds ? ` (training ${fmtSeconds(p.train_seconds)})` : ""),
      `memory: estimated ${fmtBytes(p.estimated_bytes)}, peak ${fmtBytes(p.peak_bytes)}` +
        (lane?.capacity ? ` of ${fmtBytes(lane.capacity)}` : ""),
      ...how,
      failed.length ? `failed: ${failed.map((t) => `#${t}`).join(" ")}` : "",
      p.parent_id ? `split from pack ${p.parent_id}` : "",
      p.error ? `error: ${p.error.slice(0, 160)}` : "");
    this.link.hover(p.members.map((m) => m.trial_id));
  }

  highlight(ids) {
    if (!this.svg) return;
    const set = new Set(ids);
    this.svg.classList.toggle("dimmed", set.size > 0);
    for (const [id, g] of this.groups) {
      const p = this.feed.packs.get(id);
      g.classList.toggle("lit", !!p && p.members.some((m) => set.has(m.trial_id)));
    }
  }
}

function label(g, lane, top) {
  const t = svg("text", { x: 0, y: top + 12, class: "lane-name" }, g);
  t.textContent = lane.name.length > 28 ? `…${lane.name.slice(-27)}` : lane.name;
  const sub = svg("text", { x: 0, y: top + 26, class: "lane-sub" }, g);
  sub.textContent = `${lane.packs.length} packs · busy ${Math.round(lane.busy * 100)}%`;
  const mem = svg("text", { x: 0, y: top + BAR + 22, class: "lane-sub" }, g);
  mem.textContent = lane.mem.note;
}

/** Axis labels: seconds under two minutes, then m:ss. */
function clock(t) {
  if (t < 120) return `${fmtNum(t)} s`;
  const m = Math.floor(t / 60);
  const s = Math.round(t % 60);
  return `${m}:${String(s).padStart(2, "0")}`;
}
