// The studies list: status, progress, best value, timing; a row opens the study.

import { FINISHED, getJSON, serverNow } from "./api.js";
import { fmtNum, fmtSeconds, h, seconds } from "./svg.js";

export function statusBadge(status) {
  return h("span", { class: `badge s-${status}` }, status);
}

export function progressBar(progress, status) {
  const pct = progress.total ? (100 * progress.done) / progress.total : 0;
  return h(
    "div",
    { class: `progress s-${status}`, title: `${progress.done} of ${progress.total} rung-units` },
    h("div", { class: "fill", style: `width:${pct.toFixed(1)}%` }),
    h("span", {}, `${progress.done} / ${progress.total}`)
  );
}

/** A study's fair share of device time now, e.g. "50%" (its priority and owner in the title). */
export function shareText(study) {
  const f = study.fleet;
  return f && f.share != null ? `${Math.round(f.share * 100)}%` : "";
}

export function shareTitle(study) {
  const f = study.fleet;
  if (!f) return "";
  return `priority ${fmtNum(f.priority)}` + (f.owner ? ` · owner ${f.owner}` : "") +
    ` · device time ${fmtSeconds(f.device_seconds)} · waited ${fmtSeconds(f.waiting_seconds)}`;
}

export function elapsed(study) {
  if (!study.started_at) return null;
  return seconds(study.started_at, study.finished_at ?? new Date(serverNow()).toISOString());
}

function bestValue(study) {
  const best = study.best_trial;
  if (!best) return "–";
  return `${fmtNum(best.metrics?.[study.objective.metric])} (trial ${best.id})`;
}

export class StudiesView {
  constructor(root) {
    this.root = root;
    this.key = "";
    root.replaceChildren(
      h("section", { class: "card", "data-panel": "studies" },
        h("h2", {}, "Studies"),
        (this.body = h("div", {}, h("p", { class: "muted" }, "Loading…"))))
    );
  }

  crumbs() {
    return [h("span", {}, "studies")];
  }

  async refresh() {
    const body = await getJSON("api/studies?limit=200");
    const key = JSON.stringify(body);
    if (key !== this.key) {
      this.key = key;
      this.render(body);
    }
    return body.data.some((s) => !FINISHED.has(s.status));
  }

  render(body) {
    if (body.count === 0) {
      this.body.replaceChildren(
        h("p", { class: "muted" }, "No studies yet. Submit one: ",
          h("code", {}, "packtune submit examples/digits-mlp.yaml --url " + location.origin))
      );
      return;
    }
    const rows = body.data.map((s) => {
      const trials = Object.values(s.trial_counts).reduce((a, b) => a + b, 0);
      const open = () => (location.hash = `#/studies/${s.id}`);
      return h("tr", { class: "link", onclick: open },
        h("td", { class: "num" }, s.id),
        h("td", {}, h("a", { href: `#/studies/${s.id}` }, s.name)),
        h("td", {}, s.workload),
        h("td", {}, statusBadge(s.status)),
        h("td", { class: "wide" }, progressBar(s.progress, s.status)),
        h("td", { class: "num" }, trials),
        h("td", { class: "num" }, s.packs_running || ""),
        h("td", { class: "num", "data-testid": "share", title: shareTitle(s) }, shareText(s)),
        h("td", {}, `${s.objective.metric} (${s.objective.mode})`),
        h("td", { class: "num" }, bestValue(s)),
        h("td", { class: "num" }, fmtSeconds(elapsed(s))),
        h("td", { class: "muted" }, new Date(s.created_at).toLocaleString()));
    });
    const head = ["id", "name", "workload", "status", "progress", "trials", "packs running",
      "share", "objective", "best", "time", ""];
    this.body.replaceChildren(
      h("table", { class: "table" },
        h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))),
        h("tbody", {}, rows)),
      // replaceChildren writes a null as the text "null": leave the note out instead
      ...(body.count > body.data.length
        ? [h("p", { class: "muted" }, `newest ${body.data.length} of ${body.count}`)]
        : [])
    );
  }
}
