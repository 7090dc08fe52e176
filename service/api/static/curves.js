// Learning curves: one SVG path per trial (never a node per point), metric against
// resource; the best trial drawn on top; hover finds the nearest curve.

import { unit } from "./api.js";
import {
  autoKind, axisBottom, axisLeft, fmtConfig, fmtNum, h, hideTip, niceDomain, scale,
  segmentDistance2, showTip, svg,
} from "./svg.js";

const HEIGHT = 330;
const M = { left: 58, right: 18, top: 24, bottom: 40 };
const LAYER = { stopped: "back", cancelled: "back", failed: "back", diverged: "back" };

export class CurvesPanel {
  constructor(link) {
    this.link = link;
    this.metric = null;
    this.logY = null; // null = automatic
    this.paths = new Map(); // trial id -> path element
    this.frame = null; // key of the drawn axes; a new key redraws every path
    this.select = h("select", { onchange: () => this.choose(this.select.value) });
    this.logBox = h("input", { type: "checkbox", onchange: () => this.toggleLog() });
    this.note = h("span", { class: "muted" });
    this.chart = h("div", { class: "chart" });
    this.root = h("div", {},
      h("div", { class: "controls" },
        h("label", {}, "metric ", this.select),
        h("label", {}, this.logBox, " log scale"),
        this.note),
      this.chart,
      legend());
  }

  choose(metric) {
    this.metric = metric;
    this.logY = null;
    this.frame = null;
    this.update(this.feed, null);
  }

  toggleLog() {
    this.logY = this.logBox.checked;
    this.frame = null;
    this.update(this.feed, null);
  }

  update(feed, ch) {
    this.feed = feed;
    if (!feed?.summary) return;
    this.metric ??= feed.summary.objective.metric;
    this.options(feed);
    const values = [];
    for (const points of feed.curves.values()) {
      for (const p of points) {
        const v = p.metrics?.[this.metric];
        if (typeof v === "number" && Number.isFinite(v)) values.push(v);
      }
    }
    if (values.length === 0) {
      this.chart.replaceChildren(h("p", { class: "placeholder" }, "Curves appear after the first epoch."));
      this.frame = null;
      return;
    }
    const frame = this.frameFor(feed, values);
    const key = JSON.stringify([frame.x.domain, frame.y.domain, frame.y.kind, frame.width,
      frame.rungs, feed.bestId, this.metric]);
    if (key !== this.frame || ch === null) {
      this.frame = key;
      this.draw(frame, feed);
    } else {
      const ids = new Set([...(ch.curves ?? []), ...(ch.trials ?? [])]);
      for (const id of ids) this.drawCurve(id, feed);
    }
    this.note.textContent = `${feed.curves.size} trials`;
  }

  options(feed) {
    const names = new Set([feed.summary.objective.metric]);
    for (const points of feed.curves.values()) {
      for (const key of Object.keys(points[0]?.metrics ?? {})) names.add(key);
      if (names.size > 8) break;
    }
    const have = [...this.select.options].map((o) => o.value).join();
    if (have !== [...names].join()) {
      this.select.replaceChildren(...[...names].map((n) => h("option", { value: n }, n)));
    }
    this.select.value = this.metric;
  }

  frameFor(feed, values) {
    const width = Math.max(320, this.chart.clientWidth || 640);
    const hb = feed.summary.spec.hyperband;
    const lo = Math.min(hb.min_resource ?? 1, ...[...feed.curves.values()].map((c) => c[0]?.resource ?? Infinity));
    const xKind = hb.max_resource / lo >= 9 ? "log" : "linear";
    const x = scale(xKind, [lo, hb.max_resource], [M.left, width - M.right]);
    const vmin = Math.min(...values);
    const vmax = Math.max(...values);
    const yKind = this.logY === null ? autoKind(vmin, vmax) : this.logY && vmin > 0 ? "log" : "linear";
    this.logBox.checked = yKind === "log";
    const y = scale(yKind, niceDomain(yKind, vmin, vmax), [HEIGHT - M.bottom, M.top]);
    return { x, y, width, rungs: rungResources(feed) };
  }

  draw(frame, feed) {
    this.f = frame;
    const root = svg("svg", { width: frame.width, height: HEIGHT, class: "curves" });
    const { x, y } = frame;
    axisBottom(root, x, HEIGHT - M.bottom, frame.rungs, fmtNum, HEIGHT - M.bottom - M.top);
    axisLeft(root, y, M.left, y.ticks(6), fmtNum, frame.width - M.left - M.right);
    svg("text", { x: frame.width - M.right, y: HEIGHT - 4, "text-anchor": "end", class: "label" },
      root).textContent = `${unit(feed.summary)} (rung boundaries)`;
    svg("text", { x: M.left - 6, y: M.top - 10, class: "label", "text-anchor": "end" }, root).textContent =
      this.metric;
    this.layers = {
      back: svg("g", { class: "layer back" }, root),
      front: svg("g", { class: "layer front" }, root),
      best: svg("g", { class: "layer best" }, root),
      hover: svg("g", { class: "layer hover" }, root),
    };
    this.svg = root;
    this.paths.clear();
    for (const id of feed.curves.keys()) this.drawCurve(id, feed);
    root.addEventListener("mousemove", (e) => this.hover(e));
    root.addEventListener("mouseleave", () => this.link.hover([]));
    this.chart.replaceChildren(root);
  }

  points(id) {
    const { x, y } = this.f;
    const out = [];
    for (const p of this.feed.curves.get(id) ?? []) {
      const v = p.metrics?.[this.metric];
      const ok = typeof v === "number" && Number.isFinite(v) && (y.kind !== "log" || v > 0);
      out.push(ok ? [x(p.resource), y(v)] : null);
    }
    return out;
  }

  drawCurve(id, feed) {
    const trial = feed.trials.get(id);
    if (!trial || !this.layers || !feed.curves.has(id)) return;
    const pts = this.points(id);
    let d = "";
    let pen = false;
    for (const p of pts) {
      if (!p) {
        pen = false;
        continue;
      }
      d += `${pen ? "L" : "M"}${p[0].toFixed(1)},${p[1].toFixed(1)}`;
      pen = true;
    }
    const best = id === feed.bestId;
    let path = this.paths.get(id);
    if (!path) {
      path = svg("path", { "data-trial": id });
      this.paths.set(id, path);
    }
    path.setAttribute("d", d || "M0,0");
    path.setAttribute("class", `curve s-${trial.status}${best ? " best" : ""}`);
    const layer = best ? "best" : (LAYER[trial.status] ?? "front");
    if (path.parentNode !== this.layers[layer]) this.layers[layer].appendChild(path);
  }

  hover(event) {
    const box = this.svg.getBoundingClientRect();
    const px = event.clientX - box.left;
    const py = event.clientY - box.top;
    let bestId = null;
    let bestD = 12 * 12;
    for (const id of this.paths.keys()) {
      const pts = this.points(id);
      for (let i = 0; i < pts.length; i++) {
        const a = pts[i];
        const b = pts[i + 1] ?? a;
        if (!a || !b) continue;
        const d = segmentDistance2(px, py, a[0], a[1], b[0], b[1]);
        if (d < bestD) {
          bestD = d;
          bestId = id;
        }
      }
    }
    if (bestId === null) {
      hideTip();
      this.link.hover([]);
      return;
    }
    const t = this.feed.trials.get(bestId);
    const last = this.feed.curves.get(bestId)?.at(-1);
    showTip(event, h("b", {}, `trial ${bestId}`, bestId === this.feed.bestId ? " ★ best" : ""),
      `${t.status} · bracket ${t.bracket}, rung ${t.rung}`,
      `${this.metric} ${fmtNum(last?.metrics?.[this.metric])} at ${fmtNum(last?.resource)}`,
      fmtConfig(t.config));
    this.link.hover([bestId]);
  }

  /** Draw `ids` thick on top and dim the rest (an empty list clears). */
  highlight(ids) {
    if (!this.layers) return;
    this.layers.hover.replaceChildren();
    this.svg.classList.toggle("dimmed", ids.length > 0);
    for (const id of ids) {
      const path = this.paths.get(id);
      if (!path) continue;
      const copy = path.cloneNode();
      copy.setAttribute("class", `${path.getAttribute("class")} lit`);
      this.layers.hover.appendChild(copy);
      for (const p of this.points(id)) {
        if (p) svg("circle", { cx: p[0], cy: p[1], r: 2.5, class: "dot" }, this.layers.hover);
      }
    }
    if (ids.length === 0) hideTip();
  }
}

function rungResources(feed) {
  const out = new Set();
  for (const bracket of feed.brackets) for (const rung of bracket.rungs) out.add(rung.resource);
  if (out.size === 0) out.add(feed.summary.spec.hyperband.max_resource);
  return [...out].sort((a, b) => a - b);
}

function legend() {
  const items = [["running", "training"], ["paused", "waiting for its rung"],
    ["completed", "reached the top rung"], ["stopped", "not promoted"], ["diverged", "diverged"],
    ["failed", "failed"]];
  return h("div", { class: "legend" },
    items.map(([s, text]) => h("span", {}, h("i", { class: `line s-${s}` }), text)),
    h("span", {}, h("i", { class: "line best" }), "best"));
}
