// Workers: liveness, and per GPU the memory in use and the utilisation from NVML.

import { serverNow } from "./api.js";
import { fmtBytes, fmtSeconds, h } from "./svg.js";

function meter(label, fraction, text, kind) {
  const pct = Math.max(0, Math.min(100, 100 * fraction));
  return h("div", { class: "meter-row" },
    h("span", { class: "meter-label" }, label),
    h("div", { class: `meter ${kind}` }, h("div", { class: "fill", style: `width:${pct.toFixed(1)}%` })),
    h("span", { class: "meter-text" }, text));
}

function gpuRows(gpu) {
  const total = gpu.memory_total || 0;
  const free = gpu.memory_free ?? null;
  const used = gpu.memory_used ?? (total && free !== null ? total - free : null);
  return h("div", { class: "gpu" },
    h("div", { class: "gpu-name" }, `GPU ${gpu.index ?? ""} · ${gpu.name ?? "?"}`),
    used === null
      ? h("div", { class: "muted small" }, `memory ${fmtBytes(total)}; use not reported`)
      : meter("memory", total ? used / total : 0,
          `${fmtBytes(used)} / ${fmtBytes(total)} (${fmtBytes(free ?? total - used)} free)`, "mem"),
    gpu.utilization === null || gpu.utilization === undefined
      ? h("div", { class: "muted small" }, "utilisation not reported")
      : meter("utilisation", gpu.utilization / 100, `${gpu.utilization}%`, "util"));
}

export class WorkersPanel {
  constructor() {
    this.root = h("div", { class: "workers" });
  }

  update(feed, ch) {
    if (!feed || (ch && !ch.workers && this.root.childElementCount)) return;
    if (feed.workers.length === 0) {
      this.root.replaceChildren(h("p", { class: "placeholder" }, "No worker has sent a heartbeat yet."));
      return;
    }
    this.root.replaceChildren(...feed.workers.map((w) => {
      const ago = (serverNow() - Date.parse(w.last_heartbeat)) / 1000;
      const state = w.alive ? w.status : "dead";
      return h("div", { class: `worker ${w.alive ? "" : "gone"}`, "data-worker": w.name },
        h("div", { class: "worker-head" },
          h("span", { class: `dot ${state}` }),
          h("b", {}, w.name),
          h("span", { class: `badge w-${state}` }, state)),
        h("div", { class: "muted small" },
          `${w.host} · ${w.device_kind} · heartbeat ${fmtSeconds(Math.max(0, ago))} ago`),
        ...(w.gpus ?? []).map(gpuRows),
        (w.gpus ?? []).length === 0
          ? h("div", { class: "muted small" },
              `CPU worker${w.memory_budget ? ` · memory budget ${fmtBytes(w.memory_budget)} per pack` : ""}`)
          : null);
    }));
  }
}
