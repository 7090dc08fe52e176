// The studies list: status, progress, best value, timing; a row opens the study.

import { FINISHED, getJSON, serverNow } from "./api.js";
import { fmtNum, fmtSeconds, h, seconds } from "./svg.js";

export function statusBadge(status) {
  return h("span", { class: `badge s-${status}` }, status);
}

/** Rung-units done of the total, those of failed trials apart: a failed trial's last unit
 * counts as done (the bar reaches its total however its trials end), so "6 / 6" alone read
 * as a study whose trials all trained. They are a red part of the bar and "· 3 failed". */
export function progressBar(progress, status) {
  const failed = progress.failed ?? 0;
  const pct = (n) => `width:${(progress.total ? (100 * n) / progress.total : 0).toFixed(1)}%`;
  const title = `${progress.done} of ${progress.total} rung-units` +
    (failed ? `, ${failed} of them of failed trials` : "");
  return h(
    "div",
    { class: `progress s-${status}`, title },
    h("div", { class: "fill", style: pct(progress.done - failed) }),
    failed ? h("div", { class: "fill failed", style: pct(failed) }) : null,
    h("span", {}, `${progress.done} / ${progress.total}` + (failed ? ` · ${failed} failed` : ""))
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

export const PAGE = 200; // studies a page shows unless `#/?limit=` says otherwise
export const MAX_PAGE = 500; // the API's largest page

/** `#/` with this page of the list in its query (the first page: plain `#/`). */
function pageHash(offset, limit) {
  const query = new URLSearchParams();
  if (offset > 0) query.set("offset", offset);
  if (limit !== PAGE) query.set("limit", limit);
  const text = query.toString();
  return text ? `#/?${text}` : "#/";
}

export class StudiesView {
  constructor(root, page = { offset: 0, limit: PAGE }) {
    this.root = root;
    this.page = page;
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
    const { offset, limit } = this.page;
    const body = await getJSON(`api/studies?limit=${limit}&offset=${offset}`);
    const key = JSON.stringify(body);
    if (key !== this.key) {
      this.key = key;
      this.render(body);
    }
    return body.data.some((s) => !FINISHED.has(s.status));
  }

  render(body) {
    if (body.count === 0 || body.data.length === 0) {
      if (body.count > 0) { // past the last page (a link kept while studies were deleted)
        this.body.replaceChildren(this.pager(body));
        return;
      }
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
      // replaceChildren writes a null as the text "null": leave the pager out instead
      ...(body.count > body.data.length ? [this.pager(body)] : [])
    );
  }

  /** "studies 201–400 of 1234 (newest first)", with links to the newer and older pages. */
  pager(body) {
    const { offset, limit } = this.page;
    const shown = body.data.length
      ? `studies ${offset + 1}–${offset + body.data.length} of ${body.count} (newest first)`
      : `no studies past the ${body.count} there are`;
    const link = (text, at) => h("a", { href: pageHash(at, limit), "data-testid": text }, text);
    const links = [];
    if (offset > 0) {
      const newer = body.data.length ? Math.max(0, offset - limit) : 0;
      links.push(" · ", link(body.data.length ? "newer" : "first page", newer));
    }
    if (offset + body.data.length < body.count) links.push(" · ", link("older", offset + limit));
    return h("p", { class: "muted", "data-testid": "pager" }, shown, ...links);
  }
}
