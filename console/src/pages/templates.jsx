// The templates built or imported on this server (E2B's GET /templates).
import { control, getJSON } from "../api.js";
import { when } from "../format.js";
import { usePoll } from "../hooks.js";

export function TemplatesPage() {
  const { data, error } = usePoll(() => getJSON(control("/templates")), 10000);
  return (
    <section aria-labelledby="templates-title">
      <div class="page-head"><h1 id="templates-title">Templates</h1></div>
      {error && <p class="error" role="alert">{error.message}</p>}
      {data && data.length === 0 && <p class="empty">No templates built on this server; sandboxes use the built-in ones.</p>}
      {data && data.length > 0 && (
        <table class="list" aria-label="Templates">
          <thead><tr><th>Template</th><th>Names</th><th>Build</th><th>CPU</th><th>Memory</th><th>Updated</th></tr></thead>
          <tbody>
            {data.map((t) => (
              <tr key={t.templateID}>
                <td class="mono">{t.templateID}</td>
                <td>{(t.names || t.aliases || []).join(", ")}</td>
                <td><span class={`state state-${t.buildStatus}`}>{t.buildStatus}</span> <span class="muted small">({t.buildCount} builds)</span></td>
                <td class="num">{t.cpuCount}</td>
                <td class="num">{t.memoryMB} MiB</td>
                <td>{when(t.updatedAt)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}
