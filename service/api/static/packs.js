// Plain functions over the packs payload: lanes per device, memory scales, fusion-key
// labels and the one-line summary of what packing did.

import { fmtBytes } from "./svg.js";

const FINAL = new Set(["completed", "failed", "split", "cancelled"]);

/** The device's memory in bytes: the GPU's total from the worker's NVML heartbeat, or the
 * memory budget of a CPU worker; null when the worker is unknown. */
export function capacityOf(device, workerName, workers) {
  const worker = workers.find((w) => w.name === workerName);
  if (!worker) return null;
  const gpus = (worker.gpus ?? []).filter((g) => g && g.memory_total);
  if (gpus.length === 1) return gpus[0].memory_total;
  const match = /cuda:(\d+)/.exec(device ?? "");
  if (match && gpus.length) {
    const n = Number(match[1]);
    return (gpus.find((g) => g.index === n) ?? gpus[n] ?? gpus[0]).memory_total;
  }
  return gpus.length ? gpus[0].memory_total : worker.memory_budget ?? null;
}

/** Started packs grouped by device, with capacity and the fraction of time busy. */
export function packLanes(started, workers) {
  const byName = new Map();
  for (const p of started) {
    const name = p.device ?? p.worker ?? "unassigned";
    if (!byName.has(name)) byName.set(name, []);
    byName.get(name).push(p);
  }
  return [...byName.keys()].sort().map((name) => {
    const packs = byName.get(name);
    const last = packs.reduce((best, p) => (p.id > best.id ? p : best));
    const starts = packs.map((p) => Date.parse(p.started_at));
    const ends = packs.map((p) => Date.parse(p.finished_at ?? p.started_at));
    const wall = Math.max(...ends) - Math.min(...starts);
    const busy = packs.reduce((a, p) => a + (p.duration ?? 0), 0) * 1000;
    return {
      name,
      packs,
      capacity: capacityOf(last.device, last.worker, workers),
      busy: wall > 0 ? Math.min(1, busy / wall) : 1,
    };
  });
}

/** The top of a lane's memory strip: the capacity when the packs use a visible share of it,
 * else the largest pack (and the note says how small a share that is). */
export function memoryScale(lane) {
  const use = Math.max(0, ...lane.packs.map((p) => Math.max(p.estimated_bytes ?? 0, p.peak_bytes ?? 0)));
  const cap = lane.capacity;
  if (use === 0) return { top: 1, capacityOnScale: false, note: "no memory estimates" };
  if (cap && use >= 0.1 * cap) {
    return { top: cap, capacityOnScale: true, note: `memory, top line = ${fmtBytes(cap)}` };
  }
  const share = cap ? (100 * use) / cap : null;
  const pct = share === null ? "" : share < 0.1 ? "<0.1%" : `${+share.toPrecision(2)}%`;
  return {
    top: use * 1.15,
    capacityOnScale: false,
    note: cap ? `memory ≤ ${fmtBytes(use)} (${pct} of ${fmtBytes(cap)})` : `memory ≤ ${fmtBytes(use)}`,
  };
}

function parseKey(key) {
  const bar = key.indexOf("|");
  const rest = key.slice(bar + 1);
  const segment = rest.lastIndexOf("|segment ");  // a segment unit's key ends so
  try {
    return bar >= 0 ? JSON.parse(segment >= 0 ? rest.slice(0, segment) : rest) : null;
  } catch {
    return null;
  }
}

/** fusion key -> a short label naming only the structural values that differ between keys. */
export function fusionLabels(feed) {
  const keys = [...new Set([...feed.trials.values()].map((t) => t.fusion_key))].sort();
  for (const p of feed.packs.values()) for (const m of p.members) if (!keys.includes(m.fusion_key)) keys.push(m.fusion_key);
  const parsed = keys.map(parseKey);
  const fields = new Set();
  parsed.forEach((obj) => Object.keys(obj ?? {}).forEach((f) => fields.add(f)));
  const varying = [...fields].filter(
    (f) => new Set(parsed.map((obj) => JSON.stringify(obj?.[f]))).size > 1
  );
  return new Map(
    keys.map((key, i) => {
      if (keys.length === 1) return [key, "one fusion key (all trials fusable)"];
      const obj = parsed[i];
      const text = obj ? varying.map((f) => `${f}=${obj[f]}`).join(", ") : key;
      return [key, text || key];
    })
  );
}

/** Short facts about the packs so far, for the line above the timeline. */
export function packSummary(packs, feed) {
  const ran = packs.filter((p) => p.started_at);
  const units = ran.reduce((a, p) => a + p.members.length, 0);
  const out = [];
  if (ran.length) {
    const maxK = Math.max(...ran.map((p) => p.members.length));
    out.push(`${units} units of work ran in ${ran.length} packs`);
    out.push(`${(units / ran.length).toFixed(1)} trials per pack on average, up to ${maxK}`);
  }
  const count = (s) => packs.filter((p) => p.status === s).length;
  if (count("running")) out.push(`${count("running")} running`);
  const waiting = count("queued") + count("pending");
  if (waiting) out.push(`${waiting} waiting`);
  if (count("split")) out.push(`${count("split")} split after running out of memory`);
  if (count("failed")) out.push(`${count("failed")} failed`);
  const retried = packs.filter((p) => p.attempts > 1 && FINAL.has(p.status)).length;
  if (retried) out.push(`${retried} retried`);
  if (!out.length) out.push(feed.summary.status === "pending" ? "waiting for the scheduler" : "no packs yet");
  return out;
}
