// Entry point: routes `#/` (studies; `#/?offset=200&limit=100` pages through them) and
// `#/studies/{id}` (one study), and polls.

import { MAX_PAGE, PAGE, StudiesView } from "./studies.js";
import { StudyView } from "./study.js";

const POLL_MS = 1500;
let current = null; // the mounted view: {crumbs(), refresh(): Promise<boolean>, resize()}
let timer = null;
let generation = 0;

function route() {
  const match = location.hash.match(/^#\/studies\/(\d+)/);
  if (match) return { kind: "study", id: Number(match[1]) };
  const query = new URLSearchParams(location.hash.split("?")[1] ?? "");
  return { kind: "studies", page: pageOf(query) };
}

const MAX_OFFSET = 2 ** 31 - 1; // the API's largest offset

/** The studies list's page from `#/?offset=..&limit=..`; anything else: the first page. */
function pageOf(query) {
  const number = (name, fallback, most) => {
    const value = Number(query.get(name));
    return query.has(name) && Number.isSafeInteger(value) && value >= 0
      ? Math.min(value, most) : fallback;
  };
  return { offset: number("offset", 0, MAX_OFFSET),
           limit: Math.max(1, number("limit", PAGE, MAX_PAGE)) };
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
  current = where.kind === "study" ? new StudyView(view, where.id) : new StudiesView(view, where.page);
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
