// Array sizes: per fusion key and device kind, the trial-steps/s measured for fused arrays
// of k trials training alone and for a pack's arrays of k trials training at once, and the
// size the planner cuts arrays to (only where one array alone peaks).

import { axisBottom, axisLeft, fmtBytes, fmtNum, h, linearTicks, scale, svg } from "./svg.js";

const W = 300;
const H = 150;
const M = { left: 48, right: 12, top: 12, bottom: 30 };

function chart(row) {
  const series = [
    { name: "alone", points: row.throughput, cls: "curve", label: "one array alone" },
    { name: "at-once", points: row.concurrent, cls: "curve curve-at-once", label: "arrays at once" },
  ].filter((s) => s.points.length);
  const all = series.flatMap((s) => s.points);
  const ks = [...all.map((p) => p.k), ...(row.array_size === null ? [] : [row.array_size])];
  const kLo = Math.min(...ks);
  const kHi = Math.max(...ks, kLo * 2);
  const yHi = Math.max(...all.map((p) => p.steps_per_s), 1) * 1.1;
  const x = scale("log", [kLo, kHi], [M.left, W - M.right]);
  const y = scale("linear", [0, yHi], [H - M.bottom, M.top]);
  const root = svg("svg", { class: "chart profile-chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H });
  const kTicks = [];
  for (let k = kLo; k <= kHi; k *= 2) kTicks.push(k);
  axisBottom(root, x, H - M.bottom, kTicks, (v) => String(v));
  axisLeft(root, y, M.left, linearTicks(0, yHi, 4), fmtNum, W - M.left - M.right);
  if (row.array_size !== null) {
    const chosen = x(row.array_size);
    svg("line", { class: "chosen", x1: chosen, x2: chosen, y1: M.top, y2: H - M.bottom }, root);
  }
  for (const s of series) {
    svg("polyline", {
      class: s.cls, fill: "none", "data-series": s.name,
      points: s.points.map((p) => `${x(p.k)},${y(p.steps_per_s)}`).join(" "),
    }, root);
    const best = s.name === (row.at_once ? "at-once" : "alone");
    for (const p of s.points) {
      const dot = svg("circle", {
        class: p.k === row.array_size && best ? "point chosen-point" : "point",
        cx: x(p.k), cy: y(p.steps_per_s), r: 3.5, "data-k": p.k, "data-series": s.name,
      }, root);
      svg("title", {}, dot).textContent = `k=${p.k}, ${s.label}: ${fmtNum(p.steps_per_s)} trial-steps/s`;
    }
  }
  svg("text", { x: W / 2, y: H - 2, "text-anchor": "middle", class: "axis-label" }, root)
    .textContent = "array size k (trials per fused model)";
  return root;
}

export class ProfilesPanel {
  constructor() {
    this.root = h("div", { class: "profiles" });
  }

  update(feed, ch) {
    if (!feed || (ch && !ch.profiles && this.root.childElementCount)) return;
    if (feed.profiles.length === 0) {
      this.root.replaceChildren(h("p", { class: "placeholder" },
        "Nothing measured yet: the first pack of each fusion key probes its memory and speed."));
      return;
    }
    this.root.replaceChildren(...feed.profiles.map((row) => {
      const measured = [...row.throughput, ...row.concurrent].some((p) => p.k === row.array_size);
      const memory = row.base_bytes === null ? "memory not probed yet"
        : `memory ${fmtBytes(row.base_bytes)} + k × ${fmtBytes(row.per_trial_bytes)}`;
      return h("div", { class: "profile", "data-key": row.fusion_key, "data-device": row.device_kind },
        h("div", { class: "profile-head" },
          h("b", {}, row.fusion_key), h("span", { class: "muted small" }, ` · ${row.device_kind}`)),
        h("div", { class: "muted small", "data-testid": "array-size" },
          (row.array_size === null
            ? "plans each group as one array per pack (not cut: one array alone measured no slower at larger sizes)"
            : `plans arrays of ${row.array_size}` +
              (row.capped ? " (the study's max_pack_size caps it)"
                : measured ? (row.at_once ? " (the best measured: several arrays at once)"
                  : " (the best of the measured curve)")
                : " (beyond the measured curve: exploring)")) +
          ` · ${memory}`),
        row.throughput.length || row.concurrent.length ? chart(row)
          : h("p", { class: "muted small" }, "no speed measured yet"));
    }));
  }
}
