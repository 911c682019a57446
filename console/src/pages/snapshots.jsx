// The server's snapshots (E2B's GET /snapshots): each restores into a new sandbox from the SDK.
import { control, getJSON } from "../api.js";
import { bytes, when } from "../format.js";
import { usePoll } from "../hooks.js";
import { href } from "../router.js";

export function SnapshotsPage() {
  const { data, error } = usePoll(() => getJSON(control("/snapshots?limit=100")), 10000);
  return (
    <section aria-labelledby="snapshots-title">
      <div class="page-head"><h1 id="snapshots-title">Snapshots</h1></div>
      {error && <p class="error" role="alert">{error.message}</p>}
      {data && data.length === 0 && <p class="empty">No snapshots. <code>sandbox.create_snapshot()</code> makes one.</p>}
      {data && data.length > 0 && (
        <table class="list" aria-label="Snapshots">
          <thead><tr><th>Snapshot</th><th>Names</th><th>From sandbox</th><th>Mode</th><th>Size</th><th>Created</th></tr></thead>
          <tbody>
            {data.map((s) => (
              <tr key={s.snapshotID}>
                <td class="mono">{s.snapshotID}</td>
                <td>{(s.names || []).join(", ")}</td>
                <td>{s.sandboxID ? <a class="mono" href={href("sandboxes", s.sandboxID)}>{s.sandboxID}</a> : "–"}</td>
                <td>{s.mode || "–"}</td>
                <td class="num">{bytes(s.sizeBytes)}</td>
                <td>{when(s.createdAt)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}
