// Entry point: routes `#/` (studies) and `#/studies/{id}` (one study), and polls.

import { StudiesView } from "./studies.js";
import { StudyView } from "./study.js";

const POLL_MS = 1500;
let current = null; // the mounted view: {crumbs(), refresh(): Promise<boolean>, resize()}
let timer = null;
let generation = 0;

function route() {
  const match = location.hash.match(/^#\/studies\/(\d+)/);
  return match ? { kind: "study", id: Number(match[1]) } : { kind: "studies" };
}

function setLive(state, text) {
  const node = document.getElementById("live");
  node.className = `live ${state}`;
  node.textContent = text;
}

async function poll(gen) {
  if (gen !== generation) return;
  let again = true;
  try {
    again = await current.refresh();
    setLive(again ? "on" : "idle", again ? "live" : "up to date");
  } catch (err) {
    setLive("error", "cannot reach the API; retrying");
    console.error(err);
  }
  if (gen !== generation) return;
  // A finished study is polled slowly (workers still report); a running one every 1.5 s.
  timer = setTimeout(() => poll(gen), again ? POLL_MS : POLL_MS * 4);
}

function mount() {
  generation += 1;
  clearTimeout(timer);
  const view = document.getElementById("view");
  const where = route();
  current = where.kind === "study" ? new StudyView(view, where.id) : new StudiesView(view);
  document.getElementById("crumbs").replaceChildren(...current.crumbs());
  poll(generation);
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => current?.resize?.(), 150);
});
window.addEventListener("hashchange", mount);
mount();
