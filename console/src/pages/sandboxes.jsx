// The sandboxes: live state from /ui/api/overview every 2 s, with CPU and memory sparklines.
import { useMemo, useState } from "preact/hooks";
import { getJSON } from "../api.js";
import { SandboxActions } from "../components/actions.jsx";
import { Sparkline } from "../components/charts.jsx";
import { age, bytes, pct } from "../format.js";
import { usePoll } from "../hooks.js";
import { href } from "../router.js";

const POLL_MS = 2000;

function matches(sandbox, needle) {
  if (!needle) return true;
  const hay = [sandbox.sandboxID, sandbox.templateID, sandbox.alias, sandbox.state,
    ...Object.entries(sandbox.metadata || {}).map(([k, v]) => `${k}=${v}`)].join(" ").toLowerCase();
  return needle.toLowerCase().split(/\s+/).filter(Boolean).every((word) => hay.includes(word));
}

function Row({ s, now, reload }) {
  const cpuLast = s.cpu?.length ? s.cpu[s.cpu.length - 1] : null;
  const memLast = s.mem?.length ? s.mem[s.mem.length - 1] : null;
  return (
    <tr data-sandbox-id={s.sandboxID}>
      <td>
        <a class="mono" href={href("sandboxes", s.sandboxID)}>{s.sandboxID}</a>
        {Object.keys(s.metadata || {}).length > 0 && (
          <div class="meta">{Object.entries(s.metadata).slice(0, 3).map(([k, v]) => <span class="tag">{k}={String(v)}</span>)}</div>
        )}
      </td>
      <td><span class={`state state-${s.state}`}>{s.state}</span></td>
      <td>{s.alias || s.templateID}</td>
      <td>{age(s.startedAt, now)}</td>
      <td class="spark-cell"><Sparkline values={s.cpu} label={`CPU of ${s.sandboxID}`} max={100} /> <span class="num">{pct(cpuLast)}</span></td>
      <td class="spark-cell"><Sparkline values={s.mem} label={`Memory of ${s.sandboxID}`} color="#7c3aed" /> <span class="num">{bytes(memLast)}</span></td>
      <td><SandboxActions sandbox={s} onDone={reload} /></td>
    </tr>
  );
}

export function SandboxesPage() {
  const [filter, setFilter] = useState("");
  const { data, error, reload } = usePoll(() => getJSON("/overview"), POLL_MS);
  const all = data?.sandboxes || [];
  const shown = useMemo(() => all.filter((s) => matches(s, filter)), [data, filter]);
  const now = Date.now();
  return (
    <section aria-labelledby="sandboxes-title">
      <div class="page-head">
        <h1 id="sandboxes-title">Sandboxes</h1>
        <span class="muted" role="status" aria-live="polite">
          {data ? `${shown.length} of ${all.length}${data.truncated ? "+" : ""} shown` : "Loading…"}
        </span>
        <input class="filter" type="search" aria-label="Filter sandboxes" placeholder="Filter: id, template, state, key=value"
          value={filter} onInput={(e) => setFilter(e.currentTarget.value)} />
      </div>
      {error && <p class="error" role="alert">Could not load the sandboxes: {error.message}</p>}
      {data && all.length === 0 && <p class="empty">No sandboxes are running. Create one with the SDK or `agentcell` CLI.</p>}
      {data && all.length > 0 && (
        <table class="list" aria-label="Sandboxes">
          <thead>
            <tr><th>Sandbox</th><th>State</th><th>Template</th><th>Age</th><th>CPU</th><th>Memory</th><th><span class="sr-only">Actions</span></th></tr>
          </thead>
          <tbody>{shown.map((s) => <Row key={s.sandboxID} s={s} now={now} reload={reload} />)}</tbody>
        </table>
      )}
      {data?.truncated && <p class="muted">The server lists at most 5,000 sandboxes here; filter with the API for the rest.</p>}
    </section>
  );
}
