// The behaviour report: the server's self-contained HTML report in a sandboxed iframe (no scripts, an
// opaque origin), and the same report to download as HTML and as JSON.
import { API, control, sandboxPath } from "../api.js";
import { href } from "../router.js";

export function ReportPage({ id }) {
  const base = `${API}${control(`${sandboxPath(id)}/report`)}`;
  return (
    <section aria-labelledby="report-title" class="report-page">
      <p class="crumb"><a href={href("sandboxes")}>Sandboxes</a> / <a class="mono" href={href("sandboxes", id)}>{id}</a> /</p>
      <div class="page-head">
        <h1 id="report-title">Behaviour report</h1>
        <span class="grow" />
        <a class="button quiet" href={`${base}?format=html`} download={`agentcell-report-${id}.html`}>Download HTML</a>
        <a class="button quiet" href={base} download={`agentcell-report-${id}.json`}>Download JSON</a>
      </div>
      <iframe class="report" sandbox="" src={`${base}?format=html`} title={`Behaviour report of ${id}`} />
    </section>
  );
}
