// The study's data as the page last saw it, refreshed from the JSON API and diffed,
// so each panel re-renders only what changed.

export const FINISHED = new Set(["completed", "failed", "cancelled"]);
const FINAL_PACK = new Set(["completed", "failed", "split", "cancelled"]);
const PACK_PAGE = 500; // the API's largest page
const IDS_PER_REQUEST = 100; // keeps `?trial_id=..` URLs short

/** The study's resource unit, for axis labels. */
export function unit(summary) {
  return summary?.spec?.resource_unit ?? "epochs";
}

let clockOffset = 0; // server clock minus this browser's, from the Date header

/** Milliseconds since the epoch on the server's clock (timestamps in the JSON come from it). */
export function serverNow() {
  return Date.now() + clockOffset;
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
  if (!response.ok) {
    const error = new Error(`${path}: HTTP ${response.status}`);
    error.status = response.status;
    throw error;
  }
  const date = Date.parse(response.headers.get("Date") ?? "");
  if (Number.isFinite(date)) clockOffset = date + 500 - Date.now(); // the header has whole seconds
  return response.json();
}

function chunks(items, size) {
  const out = [];
  for (let i = 0; i < items.length; i += size) out.push(items.slice(i, i + size));
  return out;
}

/** What one refresh changed; panels look at the parts they draw. */
export class Changes {
  constructor() {
    this.summary = false;
    this.trials = new Set(); // ids whose row changed
    this.curves = new Set(); // ids whose curve changed
    this.brackets = false;
    this.packs = new Set();
    this.workers = false;
    this.leaders = false;
    this.profiles = false;
  }
}

export class StudyFeed {
  constructor(id) {
    this.id = id;
    this.base = `api/studies/${id}`;
    this.summary = null;
    this.trials = new Map(); // id -> trial row
    this.curves = new Map(); // id -> [{resource, metrics}]
    this.brackets = [];
    this.packs = new Map(); // id -> pack row
    this.workers = [];
    this.leaders = [];
    this.profiles = []; // measured trial-steps/s by array size, per fusion key and device kind
    this._profilesKey = null;
    this.settled = false; // finished and fully read: only the summary and workers are polled
    this._rowKeys = new Map();
    this._statusKey = "";
    this._summaryKey = "";
    this._workersKey = "";
  }

  get running() {
    return this.summary !== null && !FINISHED.has(this.summary.status);
  }

  /** Best trial id: the final best once finished, else the leaderboard's top. */
  get bestId() {
    const s = this.summary;
    return s?.best_trial?.id ?? s?.best_so_far?.id ?? null;
  }

  async refresh() {
    const ch = new Changes();
    const [summary, workers] = await Promise.all([getJSON(this.base), getJSON("api/workers")]);
    const summaryKey = JSON.stringify(summary);
    ch.summary = summaryKey !== this._summaryKey;
    this._summaryKey = summaryKey;
    this.summary = summary;
    const workersKey = JSON.stringify(workers.data);
    ch.workers = workersKey !== this._workersKey;
    this._workersKey = workersKey;
    this.workers = workers.data;
    if (this.settled) return ch;
    const finished = FINISHED.has(summary.status);
    await this._trials(ch);
    await Promise.all([this._curves(ch), this._packs(ch), this._brackets(ch), this._leaders(ch)]);
    await this._profiles(ch);
    this.settled = finished; // read once more after the study ended, then stop
    return ch;
  }

  async _trials(ch) {
    const rows = (await getJSON(`${this.base}/trials`)).data;
    const statusParts = [];
    for (const row of rows) {
      const key = `${row.status}|${row.rung}|${row.measured_resource}|${row.updated_at}`;
      if (this._rowKeys.get(row.id) !== key) ch.trials.add(row.id);
      this._rowKeys.set(row.id, key);
      this.trials.set(row.id, row);
      statusParts.push(`${row.id}:${row.status}:${row.rung}`);
    }
    const statusKey = statusParts.join(",");
    ch.brackets = statusKey !== this._statusKey;
    this._statusKey = statusKey;
  }

  async _curves(ch) {
    const stale = [];
    for (const id of ch.trials) {
      const row = this.trials.get(id);
      const points = this.curves.get(id);
      const last = points?.length ? points[points.length - 1].resource : null;
      if (row.measured_resource !== null && row.measured_resource !== last) stale.push(id);
    }
    if (stale.length === 0) return;
    const requests =
      stale.length > this.trials.size / 2
        ? [`${this.base}/curves`]
        : chunks(stale, IDS_PER_REQUEST).map(
            (ids) => `${this.base}/curves?${ids.map((id) => `trial_id=${id}`).join("&")}`
          );
    for (const body of await Promise.all(requests.map(getJSON))) {
      for (const curve of body.data) {
        this.curves.set(curve.trial_id, curve.points);
        ch.curves.add(curve.trial_id);
      }
    }
  }

  async _brackets(ch) {
    if (!ch.brackets) return;
    this.brackets = (await getJSON(`${this.base}/brackets`)).data;
  }

  /** Read again when a pack changed (a finished pack measures its array size). */
  async _profiles(ch) {
    if (this._profilesKey !== null && ch.packs.size === 0) return;
    const rows = (await getJSON(`${this.base}/profiles`)).data;
    const key = JSON.stringify(rows);
    ch.profiles = key !== this._profilesKey;
    this._profilesKey = key;
    this.profiles = rows;
  }

  async _leaders(ch) {
    if (ch.trials.size === 0) return;
    this.leaders = (await getJSON(`${this.base}/leaderboard?limit=10`)).data;
    ch.leaders = true;
  }

  /** Newest packs first; older pages only while they may hold a pack that can still change. */
  async _packs(ch) {
    let offset = 0;
    for (;;) {
      const body = await getJSON(`${this.base}/packs?limit=${PACK_PAGE}&offset=${offset}`);
      for (const pack of body.data) {
        const old = this.packs.get(pack.id);
        if (!old || JSON.stringify(old) !== JSON.stringify(pack)) ch.packs.add(pack.id);
        this.packs.set(pack.id, pack);
      }
      offset += body.data.length;
      if (body.data.length < PACK_PAGE || offset >= body.count) return;
      const oldest = body.data[body.data.length - 1].id;
      const unsure = [...this.packs.values()].some(
        (p) => p.id < oldest && !FINAL_PACK.has(p.status)
      );
      const seen = [...this.packs.keys()].filter((id) => id < oldest).length;
      if (!unsure && seen >= body.count - offset) return; // the rest is known and final
    }
  }
}
