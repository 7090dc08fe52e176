// Small DOM, scale and formatting helpers shared by the panels (no libraries).

const SVG_NS = "http://www.w3.org/2000/svg";

/** An SVG element with attributes, appended to `parent` when given. */
export function svg(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  if (parent) parent.appendChild(node);
  return node;
}

/** An HTML element: `h("div", {class: "x"}, "text", child, ...)`. */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// -- scales ------------------------------------------------------------------------------

/** A linear or log scale from `domain` to `range`: a function with `.kind`, `.domain`, `.ticks()`. */
export function scale(kind, domain, range) {
  const f = kind === "log" ? Math.log10 : (v) => v;
  const [d0, d1] = domain;
  const [r0, r1] = range;
  const a = f(d0);
  const span = f(d1) - a || 1;
  const s = (v) => r0 + ((f(v) - a) / span) * (r1 - r0);
  s.kind = kind;
  s.domain = domain;
  s.range = range;
  s.ticks = (n = 5) => (kind === "log" ? logTicks(d0, d1) : linearTicks(d0, d1, n));
  return s;
}

function niceStep(span, n) {
  const raw = span / Math.max(1, n);
  const power = 10 ** Math.floor(Math.log10(raw));
  const unit = raw / power;
  return power * (unit <= 1 ? 1 : unit <= 2 ? 2 : unit <= 5 ? 5 : 10);
}

export function linearTicks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, n);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Math.abs(v) < step * 1e-9 ? 0 : +v.toPrecision(12));
  }
  return out;
}

export function logTicks(lo, hi) {
  const out = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    for (const m of [1, 2, 5]) {
      const v = m * 10 ** e;
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) out.push(+v.toPrecision(12));
    }
  }
  if (out.length > 7) return out.filter((v) => String(v).replace(/0|\./g, "").startsWith("1"));
  return out;
}

/** A rounded domain around [lo, hi]: multiples of a nice step, or 1-2-5 steps on a log axis. */
export function niceDomain(kind, lo, hi) {
  if (kind === "log") {
    const down = (v) => {
      const e = 10 ** Math.floor(Math.log10(v));
      return [5, 2, 1].map((m) => m * e).find((c) => c <= v * (1 + 1e-9)) ?? e;
    };
    const up = (v) => {
      const e = 10 ** Math.floor(Math.log10(v));
      return [1, 2, 5, 10].map((m) => m * e).find((c) => c >= v * (1 - 1e-9));
    };
    return [down(lo), up(hi)];
  }
  if (!(hi > lo)) return [lo - 1, hi + 1];
  const step = niceStep(hi - lo, 5);
  return [Math.floor(lo / step) * step, Math.ceil(hi / step) * step];
}

/** Log when the values are positive and span more than `ratio`. */
export function autoKind(lo, hi, ratio = 30) {
  return lo > 0 && hi / lo > ratio ? "log" : "linear";
}

// -- axes ----------------------------------------------------------------------------------

export function axisBottom(parent, s, y, ticks, fmt = fmtNum, grid = 0) {
  const g = svg("g", { class: "axis" }, parent);
  svg("line", { x1: s.range[0], x2: s.range[1], y1: y, y2: y }, g);
  for (const t of ticks) {
    const x = s(t);
    if (grid) svg("line", { class: "grid", x1: x, x2: x, y1: y, y2: y - grid }, g);
    svg("line", { x1: x, x2: x, y1: y, y2: y + 4 }, g);
    svg("text", { x, y: y + 16, "text-anchor": "middle" }, g).textContent = fmt(t);
  }
  return g;
}

export function axisLeft(parent, s, x, ticks, fmt = fmtNum, grid = 0) {
  const g = svg("g", { class: "axis" }, parent);
  svg("line", { x1: x, x2: x, y1: s.range[0], y2: s.range[1] }, g);
  for (const t of ticks) {
    const y = s(t);
    if (grid) svg("line", { class: "grid", x1: x, x2: x + grid, y1: y, y2: y }, g);
    svg("line", { x1: x - 4, x2: x, y1: y, y2: y }, g);
    svg("text", { x: x - 7, y: y + 4, "text-anchor": "end" }, g).textContent = fmt(t);
  }
  return g;
}

// -- formatting ----------------------------------------------------------------------------

export function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4 || a < 1e-3) return v.toExponential(1).replace("e+", "e");
  return String(+v.toPrecision(4));
}

export function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) {
    b /= 1024;
    i++;
  }
  return `${b >= 100 || i === 0 ? Math.round(b) : b.toFixed(1)} ${units[i]}`;
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

export function fmtConfig(config) {
  return Object.entries(config || {})
    .map(([k, v]) => `${k}=${fmtNum(v)}`)
    .join(", ");
}

export function seconds(a, b) {
  return (Date.parse(b) - Date.parse(a)) / 1000;
}

// -- tooltip ---------------------------------------------------------------------------------

const tip = () => document.getElementById("tooltip");

/** Show `lines` (strings or nodes) near the pointer. */
export function showTip(event, ...lines) {
  const node = tip();
  node.replaceChildren(...lines.map((line) => h("div", {}, line)));
  node.hidden = false;
  const pad = 14;
  const { innerWidth: w, innerHeight: ht } = window;
  const box = node.getBoundingClientRect();
  let x = event.clientX + pad;
  let y = event.clientY + pad;
  if (x + box.width > w - 4) x = event.clientX - box.width - pad;
  if (y + box.height > ht - 4) y = event.clientY - box.height - pad;
  node.style.left = `${Math.max(4, x)}px`;
  node.style.top = `${Math.max(4, y)}px`;
}

export function hideTip() {
  tip().hidden = true;
}

/** Squared distance from (px, py) to the segment (ax, ay)-(bx, by). */
export function segmentDistance2(px, py, ax, ay, bx, by) {
  const dx = bx - ax;
  const dy = by - ay;
  const len = dx * dx + dy * dy;
  const t = len ? Math.max(0, Math.min(1, ((px - ax) * dx + (py - ay) * dy) / len)) : 0;
  const x = ax + t * dx - px;
  const y = ay + t * dy - py;
  return x * x + y * y;
}
