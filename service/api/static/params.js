// Parallel coordinates: one axis per hyperparameter of the space, then the resource a
// trial reached and its objective there; one path per trial, darker = ranked higher.

import { unit } from "./api.js";
import {
  autoKind, fmtConfig, fmtNum, h, hideTip, linearTicks, logTicks, niceDomain, scale,
  segmentDistance2, showTip, svg,
} from "./svg.js";

const HEIGHT = 300;
const M = { left: 40, right: 60, top: 34, bottom: 16 };

function axisFor(name, def, y0, y1) {
  if (def.type === "choice") {
    const values = def.values.map((v) => JSON.stringify(v));
    const step = values.length > 1 ? (y0 - y1) / (values.length - 1) : 0;
    const pos = (v) => (values.length > 1 ? y0 - values.indexOf(JSON.stringify(v)) * step : (y0 + y1) / 2);
    return { name, pos, ticks: def.values.map((v) => [pos(v), fmtNum(v)]) };
  }
  const log = def.type === "loguniform" || (def.type === "int" && def.log);
  const s = scale(log ? "log" : "linear", [def.low, def.high], [y0, y1]);
  const ticks = (log ? logTicks(def.low, def.high) : linearTicks(def.low, def.high, 4)).map((t) => [s(t), fmtNum(t)]);
  return { name: log ? `${name} (log)` : name, pos: s, ticks };
}

export class ParamsPanel {
  constructor(link) {
    this.link = link;
    this.paths = new Map();
    this.frameKey = null;
    this.chart = h("div", { class: "chart" });
    this.root = h("div", {}, this.chart,
      h("div", { class: "legend" },
        h("span", {}, h("i", { class: "ramp" }), (this.ramp = h("span", {}))),
        h("span", {}, h("i", { class: "line best" }), "best"),
        h("span", {}, h("i", { class: "line unmeasured" }), "not measured yet")));
  }

  update(feed, ch) {
    this.feed = feed;
    if (!feed?.summary || feed.trials.size === 0) return;
    const s = feed.summary;
    const metric = s.objective.metric;
    const values = [...feed.trials.values()]
      .map((t) => t.metrics?.[metric])
      .filter((v) => typeof v === "number" && Number.isFinite(v));
    const width = Math.max(360, this.chart.clientWidth || 600);
    const vmin = values.length ? Math.min(...values) : 0;
    const vmax = values.length ? Math.max(...values) : 1;
    const kind = autoKind(vmin, vmax);
    const domain = niceDomain(kind, vmin, vmax);
    const key = JSON.stringify([width, domain, kind, feed.bestId]);
    if (key !== this.frameKey || ch === null) {
      this.frameKey = key;
      this.draw(feed, width, kind, domain);
    } else {
      for (const id of ch.trials) this.drawTrial(id);
    }
    this.colour();
  }

  draw(feed, width, kind, domain) {
    const s = feed.summary;
    const space = s.spec.space;
    const hb = s.spec.hyperband;
    const y0 = HEIGHT - M.bottom;
    const y1 = M.top;
    const axes = Object.entries(space).map(([name, def]) => axisFor(name, def, y0, y1));
    const lo = hb.min_resource ?? 1;
    const rKind = hb.max_resource / lo >= 9 ? "log" : "linear";
    const r = scale(rKind, [lo, hb.max_resource], [y0, y1]);
    const rungs = [...new Set(feed.brackets.flatMap((b) => b.rungs.map((g) => g.resource)))];
    axes.push({ name: unit(s), pos: r, ticks: rungs.map((v) => [r(v), fmtNum(v)]), resource: true, floor: lo });
    const o = scale(kind, domain, [y0, y1]);
    axes.push({
      name: `${s.objective.metric} (${s.objective.mode})`,
      pos: o,
      ticks: o.ticks(5).map((t) => [o(t), fmtNum(t)]),
      objective: true,
    });
    const step = (width - M.left - M.right) / Math.max(1, axes.length - 1);
    axes.forEach((a, i) => (a.x = M.left + i * step));
    this.axes = axes;
    const root = svg("svg", { width, height: HEIGHT, class: "params" });
    this.layers = { back: svg("g", {}, root), front: svg("g", {}, root), best: svg("g", {}, root),
      hover: svg("g", {}, root) };
    for (const a of axes) {
      const g = svg("g", { class: "axis" }, root);
      svg("line", { x1: a.x, x2: a.x, y1: y0, y2: y1 }, g);
      svg("text", { x: a.x, y: M.top - 14, "text-anchor": "middle", class: "axis-name" }, g).textContent = a.name;
      for (const [y, text] of a.ticks) {
        svg("line", { x1: a.x - 3, x2: a.x, y1: y, y2: y }, g);
        svg("text", { x: a.x - 5, y: y + 3, "text-anchor": "end" }, g).textContent = text;
      }
    }
    this.svg = root;
    this.paths.clear();
    for (const id of feed.trials.keys()) this.drawTrial(id);
    root.addEventListener("mousemove", (e) => this.hover(e));
    root.addEventListener("mouseleave", () => this.link.hover([]));
    this.chart.replaceChildren(root);
  }

  points(id) {
    const t = this.feed.trials.get(id);
    const metric = this.feed.summary.objective.metric;
    const out = [];
    for (const a of this.axes) {
      let v;
      // a trial that diverged inside its first rung was measured below min_resource: on
      // the axis's floor, not below the chart
      if (a.resource) v = t.measured_resource === null ? null : Math.max(t.measured_resource, a.floor);
      else if (a.objective) v = t.metrics?.[metric];
      else v = t.config?.[a.name.replace(" (log)", "")];
      const ok = v !== null && v !== undefined && (typeof v !== "number" || Number.isFinite(v));
      const y = ok ? a.pos(v) : NaN;
      if (!Number.isFinite(y)) break;
      out.push([a.x, y]);
    }
    return out;
  }

  drawTrial(id) {
    if (!this.layers) return;
    const t = this.feed.trials.get(id);
    const pts = this.points(id);
    let path = this.paths.get(id);
    if (!path) {
      path = svg("path", { "data-trial": id, fill: "none" });
      this.paths.set(id, path);
    }
    path.setAttribute("d", pts.length ? `M${pts.map((p) => `${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("L")}` : "M0,0");
    const best = id === this.feed.bestId;
    const measured = t.measured_resource !== null;
    path.setAttribute("class", `pc${best ? " best" : ""}${measured ? "" : " unmeasured"}`);
    const layer = best ? "best" : measured ? "front" : "back";
    if (path.parentNode !== this.layers[layer]) this.layers[layer].appendChild(path);
  }

  /** Colour by leaderboard order: trials that went further first, then by the objective. */
  colour() {
    const s = this.feed.summary;
    const sign = s.objective.mode === "max" ? -1 : 1;
    const metric = s.objective.metric;
    const ranked = [...this.feed.trials.values()]
      .filter((t) => t.measured_resource !== null)
      .map((t) => {
        const v = t.metrics?.[metric];
        const ok = typeof v === "number" && Number.isFinite(v);
        return { id: t.id, key: [ok ? 0 : 1, -t.measured_resource, ok ? sign * v : 0, t.id] };
      })
      .sort((a, b) => a.key.reduce((acc, x, i) => acc || (x < b.key[i] ? -1 : x > b.key[i] ? 1 : 0), 0));
    // With many trials only the leading ones are coloured (drawn over the rest, in grey).
    const many = ranked.length > 60;
    const lead = many ? Math.max(20, Math.ceil(ranked.length / 10)) : ranked.length;
    for (let i = ranked.length - 1; i >= 0; i--) {
      const id = ranked[i].id;
      const path = this.paths.get(id);
      if (!path || id === this.feed.bestId) continue;
      const q = Math.min(1, lead > 1 ? i / (lead - 1) : 0);
      const colour = i < lead ? `hsl(221, ${Math.round(75 - q * 40)}%, ${Math.round(28 + q * 45)}%)` : "#cbd5e1";
      if (path.dataset.colour !== colour) {
        path.dataset.colour = colour;
        path.style.stroke = colour;
        path.style.strokeOpacity = i < lead ? (0.9 - 0.3 * q).toFixed(2) : "0.25";
      }
      if (many && path.parentNode === this.layers.front) this.layers.front.appendChild(path);
    }
    this.ramp.textContent = many
      ? `the leading ${lead} of ${ranked.length} measured trials, dark = further and better`
      : "leaderboard rank: dark = further and better";
  }

  hover(event) {
    const box = this.svg.getBoundingClientRect();
    const px = event.clientX - box.left;
    const py = event.clientY - box.top;
    let found = null;
    let dmin = 8 * 8;
    for (const id of this.paths.keys()) {
      const pts = this.points(id);
      for (let i = 0; i + 1 < pts.length; i++) {
        const d = segmentDistance2(px, py, ...pts[i], ...pts[i + 1]);
        if (d < dmin) {
          dmin = d;
          found = id;
        }
      }
    }
    if (found === null) {
      this.link.hover([]);
      return;
    }
    const t = this.feed.trials.get(found);
    const metric = this.feed.summary.objective.metric;
    showTip(event, h("b", {}, `trial ${found}`, found === this.feed.bestId ? " ★ best" : ""),
      `${metric} ${fmtNum(t.metrics?.[metric])} at ${fmtNum(t.measured_resource)} · ${t.status}`,
      fmtConfig(t.config));
    this.link.hover([found]);
  }

  highlight(ids) {
    if (!this.layers) return;
    this.layers.hover.replaceChildren();
    this.svg.classList.toggle("dimmed", ids.length > 0);
    for (const id of ids) {
      const path = this.paths.get(id);
      if (path) {
        const copy = path.cloneNode();
        copy.setAttribute("class", "pc lit");
        copy.style.stroke = "";
        copy.style.strokeOpacity = "";
        this.layers.hover.appendChild(copy);
      }
    }
    if (ids.length === 0) hideTip();
  }
}
