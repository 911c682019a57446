// One output of a code cell, rendered without ever putting its text into the page as HTML: images as
// <img> from data: URLs (an SVG in an <img> runs no script), HTML in a sandboxed iframe (no scripts, an
// opaque origin), a DataFrame's columns as a table, text as text.

const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;
const plain = (text) => String(text ?? "").replace(ANSI, "");

// E2B's result.data: a DataFrame as {column: [values...]}
function DataTable({ data }) {
  const columns = Object.keys(data);
  const rows = Math.max(0, ...columns.map((c) => (Array.isArray(data[c]) ? data[c].length : 0)));
  const shown = Math.min(rows, 500);
  return (
    <div class="table-wrap">
      <table class="list compact dataframe" aria-label="Result table">
        <thead><tr><th class="muted">#</th>{columns.map((c) => <th>{c}</th>)}</tr></thead>
        <tbody>
          {Array.from({ length: shown }, (_, i) => (
            <tr><td class="muted num">{i}</td>{columns.map((c) => <td>{data[c]?.[i] == null ? "" : String(data[c][i])}</td>)}</tr>
          ))}
        </tbody>
      </table>
      {rows > shown && <p class="muted small">{rows - shown} more rows not shown</p>}
    </div>
  );
}

const isTable = (data) => data && typeof data === "object" && !Array.isArray(data)
  && Object.keys(data).length > 0 && Object.values(data).every(Array.isArray);

function Result({ item }) {
  if (item.png) return <img class="result-image" src={`data:image/png;base64,${item.png}`} alt="Result image (PNG)" />;
  if (item.jpeg) return <img class="result-image" src={`data:image/jpeg;base64,${item.jpeg}`} alt="Result image (JPEG)" />;
  if (item.svg) return <img class="result-image" src={`data:image/svg+xml;charset=utf-8,${encodeURIComponent(item.svg)}`} alt="Result image (SVG)" />;
  if (isTable(item.data)) return <DataTable data={item.data} />;
  if (item.html) return <iframe class="result-html" sandbox="" srcdoc={item.html} title="Result (HTML)" />;
  if (item.json != null) return <pre class="result-text">{JSON.stringify(item.json, null, 2)}</pre>;
  if (item.markdown) return <pre class="result-text">{item.markdown}</pre>;
  if (item.latex) return <pre class="result-text">{item.latex}</pre>;
  if (item.text != null) return <pre class="result-text">{item.text}</pre>;
  return <pre class="result-text muted">(a result in a format the console does not show: {Object.keys(item).join(", ")})</pre>;
}

export function Output({ item }) {
  if (item.type === "stdout" || item.type === "stderr") return <pre class={`stream ${item.type}`}>{plain(item.text)}</pre>;
  if (item.type === "result") return <div class="result">{item.is_main_result && <span class="out-label">Out:</span>}<Result item={item} /></div>;
  if (item.type === "error") {
    return (
      <pre class="stream cell-error" role="alert">
        <strong>{item.name}: {item.value}</strong>
        {item.traceback ? `\n${plain(item.traceback)}` : ""}
      </pre>
    );
  }
  return null;
}
