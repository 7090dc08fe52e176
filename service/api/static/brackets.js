// Hyperband's brackets: one row per bracket, one block per rung, one cell per planned slot.
// A cell is a trial that reached the rung, coloured by what happened to it there.

import { unit } from "./api.js";
import { fmtConfig, fmtNum, h, hideTip, showTip } from "./svg.js";

/** Columns of a rung's grid: wide and flat for small rungs, squarer for big ones. */
function columns(n, density) {
  return Math.max(1, Math.min(n, Math.ceil(Math.sqrt(n * (density ? 2 : 3)))));
}

/** "" for up to 60 trials in rung 0, then smaller cells: "dense", "denser". */
function densityOf(n) {
  return n > 150 ? "denser" : n > 60 ? "dense" : "";
}

function cellState(trial) {
  if (trial.promoted) return "promoted";
  return trial.status;
}

export class BracketsPanel {
  constructor(link) {
    this.link = link;
    this.rows = new Map(); // s -> {key, node}
    this.list = h("div", { class: "brackets" });
    this.root = h("div", {}, this.list, legend());
    this.lit = [];
    this.root.addEventListener("mouseover", (e) => this.hover(e));
    this.root.addEventListener("mouseleave", () => this.link.hover([]));
  }

  update(feed, ch) {
    this.feed = feed;
    if (!feed?.summary || (ch && !ch.brackets && this.rows.size)) return;
    if (feed.brackets.length === 0) {
      this.list.replaceChildren(h("p", { class: "placeholder" }, "Trials are sampled when the study starts."));
      return;
    }
    const eta = feed.summary.spec.hyperband.eta;
    const nodes = feed.brackets.map((bracket) => {
      const key = JSON.stringify(bracket);
      const id = `${bracket.iteration}:${bracket.s}`;
      const old = this.rows.get(id);
      if (old && old.key === key) return old.node;
      const node = this.renderBracket(bracket, eta, feed);
      this.rows.set(id, { key, node });
      return node;
    });
    if (nodes.some((node, i) => this.list.children[i] !== node)) this.list.replaceChildren(...nodes);
  }

  renderBracket(bracket, eta, feed) {
    const first = bracket.rungs[0];
    const density = densityOf(first.n);
    const blocks = [];
    bracket.rungs.forEach((rung, i) => {
      if (i > 0) {
        blocks.push(h("div", { class: "arrow", title: `the best ⌊n/η⌋ go on` },
          h("span", {}, `top ${rung.n}`), h("span", { class: "arrowhead" }, "→")));
      }
      const cells = rung.trials.map((t) =>
        h("span", { class: `cell s-${cellState(t)}`, "data-trial": t.trial_id, "data-rung": i }));
      for (let k = rung.trials.length; k < rung.n; k++) cells.push(h("span", { class: "cell empty" }));
      blocks.push(
        h("div", { class: "rung" },
          h("div", { class: "rung-head" },
            h("span", {}, h("b", {}, `rung ${i}`), ` ${rung.trials.length}/${rung.n}`),
            h("span", { class: "muted" }, `${fmtNum(rung.resource)} ${unit(feed.summary)}`)),
          h("div", {
            class: `cells ${density}`,
            style: `grid-template-columns: repeat(${columns(rung.n, density)}, var(--cell))`,
          }, cells))
      );
    });
    const done = bracket.rungs.at(-1).trials.filter((t) => t.status === "completed").length;
    const several = feed.brackets.some((b) => b.iteration > 0);
    return h("div", { class: "bracket", "data-s": bracket.s, "data-iteration": bracket.iteration },
      h("div", { class: "bracket-head" },
        h("b", {}, several ? `iteration ${bracket.iteration + 1} · s = ${bracket.s}` : `s = ${bracket.s}`),
        h("span", { class: "muted" }, `${first.n} trials from ${fmtNum(first.resource)} ${unit(feed.summary)}`),
        h("span", { class: "muted" }, `η = ${eta}`),
        done ? h("span", { class: "done" }, "✓ finished") : null),
      h("div", { class: "rungs" }, blocks));
  }

  hover(event) {
    const cell = event.target.closest?.(".cell[data-trial]");
    if (!cell) {
      if (this.lit.length) this.link.hover([]);
      return;
    }
    const id = Number(cell.dataset.trial);
    const rung = Number(cell.dataset.rung);
    const trial = this.feed.trials.get(id);
    if (!trial) return;
    const bracket = this.feed.brackets.find(
      (b) => b.s === trial.bracket && b.iteration === (trial.iteration ?? 0));
    const resource = bracket?.rungs[rung]?.resource;
    const metric = this.feed.summary.objective.metric;
    const point = (this.feed.curves.get(id) ?? []).find((p) => p.resource === resource);
    const state = cellState(bracket.rungs[rung].trials.find((t) => t.trial_id === id) ?? {});
    showTip(event, h("b", {}, `trial ${id}`), `rung ${rung}: ${state}`,
      `${metric} ${fmtNum(point?.metrics?.[metric])} at ${fmtNum(resource)}`,
      fmtConfig(trial.config),
      trial.error ? h("span", { class: "error" }, `${trial.status}: ${trial.error.slice(0, 300)}`) : "");
    this.link.hover([id]);
  }

  highlight(ids) {
    for (const node of this.lit) node.classList.remove("lit");
    this.lit = [];
    this.list.classList.toggle("dimmed", ids.length > 0);
    if (ids.length === 0) hideTip();
    for (const id of ids) {
      for (const node of this.list.querySelectorAll(`.cell[data-trial="${id}"]`)) {
        node.classList.add("lit");
        this.lit.push(node);
      }
    }
  }
}

function legend() {
  const items = [["pending", "waiting"], ["queued", "queued"], ["running", "training"],
    ["paused", "done, rung still open"], ["promoted", "promoted"], ["stopped", "stopped"],
    ["completed", "completed"], ["diverged", "diverged"], ["failed", "failed"],
    ["empty", "slot not reached yet"]];
  return h("div", { class: "legend" },
    items.map(([s, text]) => h("span", {}, h("i", { class: `cell s-${s}${s === "empty" ? " empty" : ""}` }), text)));
}
