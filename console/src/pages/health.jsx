// The server's health: sandboxes, the warm pool, admission, egress and the behaviour record.
import { getJSON } from "../api.js";
import { KeyValues } from "../components/kv.jsx";
import { age, bytes } from "../format.js";
import { usePoll } from "../hooks.js";

function Stat({ label, value, note }) {
  return (
    <div class="stat" role="group" aria-label={label}>
      <div class="stat-label">{label}</div>
      <div class="stat-value">{value ?? "–"}</div>
      {note && <div class="muted small">{note}</div>}
    </div>
  );
}

export function HealthPage() {
  const { data: h, error } = usePoll(() => getJSON("/health"), 5000);
  return (
    <section aria-labelledby="health-title">
      <div class="page-head">
        <h1 id="health-title">Server health</h1>
        {h && <span class="muted">{h.version ? `agentcell ${h.version}` : ""}{h.uptime_s != null ? ` · up ${age(Date.now() / 1000 - h.uptime_s)}` : ""}</span>}
      </div>
      {error && <p class="error" role="alert">{error.message}</p>}
      {h && (
        <>
          <div class="stats">
            {h.sandboxes && <Stat label="Running sandboxes" value={h.sandboxes.running} note={h.sandboxes.max != null ? `of at most ${h.sandboxes.max}` : null} />}
            {h.sandboxes && <Stat label="Paused sandboxes" value={h.sandboxes.paused} />}
            {h.pool && <Stat label="Warm pool" value={h.pool.standbys} note={h.pool.target != null ? `target ${h.pool.target}` : null} />}
            {h.record && <Stat label="Record events" value={h.record.events} note={h.record.bytes != null ? bytes(h.record.bytes) : null} />}
            {h.record && <Stat label="Record drops" value={h.record.dropped} />}
          </div>
          <div class="grid2">
            {h.admission && <section aria-labelledby="admission-title"><h2 id="admission-title">Admission</h2><KeyValues object={h.admission} label="Admission" /></section>}
            {h.egress && <section aria-labelledby="egress-title"><h2 id="egress-title">Egress</h2><KeyValues object={h.egress} label="Egress" /></section>}
            {h.pool && <section aria-labelledby="pool-title"><h2 id="pool-title">Pool</h2><KeyValues object={h.pool} label="Pool" /></section>}
            {h.record && <section aria-labelledby="record-title"><h2 id="record-title">Behaviour record</h2><KeyValues object={h.record} label="Behaviour record" /></section>}
          </div>
        </>
      )}
    </section>
  );
}
