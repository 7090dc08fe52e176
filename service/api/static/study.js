// One study: the summary, then a panel per view; each panel redraws only what changed.

import { StudyFeed, unit } from "./api.js";
import { BracketsPanel } from "./brackets.js";
import { CurvesPanel } from "./curves.js";
import { ParamsPanel } from "./params.js";
import { ProfilesPanel } from "./profiles.js";
import { elapsed, progressBar, statusBadge } from "./studies.js";
import { fmtConfig, fmtNum, fmtSeconds, h } from "./svg.js";
import { TimelinePanel } from "./timeline.js";
import { WorkersPanel } from "./workers.js";

const TRIAL_ORDER = ["running", "queued", "pending", "paused", "completed", "stopped",
  "diverged", "failed", "cancelled"];

function card(name, title, ...rest) {
  return h("section", { class: `card panel-${name}`, "data-panel": name }, h("h2", {}, title), ...rest);
}

/** Hover on a trial or a pack in one panel highlights the same trials in the others. */
class Link {
  constructor() {
    this.panels = [];
    this.current = "";
  }

  hover(ids) {
    const key = ids.join(",");
    if (key === this.current) return; // the pointer moved within the same trial or pack
    this.current = key;
    for (const panel of this.panels) panel.highlight?.(ids);
  }

  /** Panels redrew their charts: draw the highlight again on the new ones. */
  redraw() {
    const ids = this.current ? this.current.split(",").map(Number) : [];
    for (const panel of this.panels) panel.highlight?.(ids);
  }
}

export class StudyView {
  constructor(root, id) {
    this.id = id;
    this.root = root;
    this.feed = new StudyFeed(id);
    this.link = new Link();
    this.head = h("div", { class: "summary-body" }, h("p", { class: "muted" }, "Loading…"));
    this.board = h("div", {});
    this.panels = {
      curves: new CurvesPanel(this.link),
      brackets: new BracketsPanel(this.link),
      timeline: new TimelinePanel(this.link),
      params: new ParamsPanel(this.link),
      workers: new WorkersPanel(),
      profiles: new ProfilesPanel(),
    };
    this.link.panels = [this.panels.curves, this.panels.brackets, this.panels.timeline,
      this.panels.params];
    const p = this.panels;
    root.replaceChildren(
      card("summary", "", this.head),
      h("div", { class: "row" },
        card("curves", "Learning curves", p.curves.root),
        card("leaderboard", "Leaderboard", this.board)),
      card("brackets", "Brackets and rungs", p.brackets.root),
      card("timeline", "Packs per device", p.timeline.root),
      card("profiles", "Array sizes: trial-steps/s measured by trials per fused model", p.profiles.root),
      h("div", { class: "row" },
        card("params", "Hyperparameters against the objective", p.params.root),
        card("workers", "Workers", p.workers.root))
    );
  }

  crumbs() {
    return [h("a", { href: "#/" }, "studies"), h("span", {}, " / "), h("span", {}, `study ${this.id}`)];
  }

  async refresh() {
    let ch;
    try {
      ch = await this.feed.refresh();
    } catch (err) {
      if (err.status !== 404 && err.status !== 422) throw err; // 422: an id no study can have
      this.root.replaceChildren(h("section", { class: "card" },
        h("h2", {}, `Study ${this.id} not found`), h("a", { href: "#/" }, "All studies")));
      return false;
    }
    if (ch.summary || ch.leaders) this.renderSummary();
    if (ch.leaders) this.renderBoard();
    for (const panel of Object.values(this.panels)) panel.update(this.feed, ch);
    if (this.link.current) this.link.redraw();
    return !this.feed.settled;
  }

  resize() {
    for (const panel of Object.values(this.panels)) panel.update(this.feed, null);
  }

  renderSummary() {
    const s = this.feed.summary;
    const hb = s.spec.hyperband;
    const packing = s.spec.packing ?? {};
    const counts = s.trial_counts;
    const total = Object.values(counts).reduce((a, b) => a + b, 0);
    const chips = TRIAL_ORDER.filter((k) => counts[k]).map((k) =>
      h("span", { class: `chip s-${k}` }, `${counts[k]} ${k}`));
    const packs = [...this.feed.packs.values()];
    const ran = packs.filter((p) => p.started_at);
    const members = ran.reduce((a, p) => a + p.members.length, 0);
    const best = s.best_trial ?? s.best_so_far;
    const metric = s.objective.metric;
    const bestBox = best
      ? h("div", { class: "best" },
          h("div", { class: "kpi-label" }, s.best_trial ? "best trial" : "best so far"),
          h("div", { class: "best-value" }, `${metric} ${fmtNum(best.metrics?.[metric])}`),
          h("div", { class: "muted" }, `trial ${best.id}` +
            (best.measured_resource ? ` at ${fmtNum(best.measured_resource)} ${unit(s)}` : "")),
          h("dl", { class: "config" }, Object.entries(best.config).flatMap(([k, v]) =>
            [h("dt", {}, k), h("dd", {}, fmtNum(v))])))
      : h("div", { class: "best muted" }, "no measurement yet");
    this.head.replaceChildren(
      h("div", { class: "summary-main" },
        h("div", { class: "title" }, h("h1", {}, s.name), statusBadge(s.status)),
        h("div", { class: "muted" },
          `study ${s.id} · ${s.workload} · ${s.objective.mode === "min" ? "minimise" : "maximise"} ` +
          `${metric} · Hyperband R=${fmtNum(hb.max_resource)}, η=${hb.eta}` +
          ` · packing ${packing.enabled === false ? "off" : "on"}` +
          (packing.max_pack_size ? ` (at most ${packing.max_pack_size} per pack)` : "")),
        progressBar(s.progress, s.status),
        s.budget ? h("div", { class: "muted budget", "data-testid": "budget" }, budgetText(s.budget)) : null,
        h("div", { class: "kpis" },
          kpi("elapsed", fmtSeconds(elapsed(s))),
          kpi("trials", total),
          kpi("packs run", ran.length, s.packs_running ? `${s.packs_running} running` : ""),
          kpi("trials per pack", ran.length ? (members / ran.length).toFixed(1) : "–",
            ran.length ? `max ${Math.max(...ran.map((p) => p.members.length))}` : ""),
          s.fleet ? kpi("device time", fmtSeconds(s.fleet.device_seconds),
            `waited ${fmtSeconds(s.fleet.waiting_seconds)}` +
            (s.fleet.share != null ? ` · share ${Math.round(s.fleet.share * 100)}%` : "") +
            ` · priority ${fmtNum(s.fleet.priority)}` +
            (s.fleet.owner ? ` · ${s.fleet.owner}` : "")) : null),
        h("div", { class: "chips" }, chips),
        s.error ? h("p", { class: "error" }, s.error) : null),
      bestBox
    );
  }

  renderBoard() {
    const s = this.feed.summary;
    const rows = this.feed.leaders.map((t) =>
      h("tr", {
        "data-trial": t.id,
        onmouseenter: () => this.link.hover([t.id]),
        onmouseleave: () => this.link.hover([]),
      },
        h("td", { class: "num" }, t.rank),
        h("td", { class: "num" }, `#${t.id}`),
        h("td", { class: "num" }, fmtNum(t.value)),
        h("td", { class: "num" }, fmtNum(t.measured_resource)),
        h("td", { class: `st s-${t.status}` }, t.status),
        h("td", { class: "cfg", title: fmtConfig(t.config) }, fmtConfig(t.config))));
    this.board.replaceChildren(
      rows.length
        ? h("table", { class: "table compact" },
            h("thead", {}, h("tr", {}, ["#", "trial", s.objective.metric, unit(s), "status",
              "config"].map((c) => h("th", {}, c)))),
            h("tbody", {}, rows))
        : h("p", { class: "muted" }, "No measurements yet.")
    );
  }
}

function kpi(label, value, note = "") {
  return h("div", { class: "kpi" }, h("div", { class: "kpi-value" }, value),
    h("div", { class: "kpi-label" }, label), note ? h("div", { class: "kpi-note" }, note) : null);
}

// The sampler, the budget and how much of it is used, e.g.
// "sampler tpe · iteration 2 of 3 · 61 trials · 40 s of 600 s".
export function budgetText(b) {
  const parts = [`sampler ${b.sampler}`];
  parts.push(`iteration ${b.iterations}` + (b.max_iterations ? ` of ${b.max_iterations}` : ""));
  parts.push(`${b.trials}` + (b.max_trials ? ` of ${b.max_trials}` : "") + " trials");
  if (b.max_seconds) parts.push(`${fmtSeconds(b.seconds ?? 0)} of ${fmtSeconds(b.max_seconds)}`);
  if (b.target !== null && b.target !== undefined) parts.push(`target ${fmtNum(b.target)}`);
  if (b.stop_reason) parts.push(`stopped by ${b.stop_reason}`);
  return parts.join(" · ");
}
