// A code cell on the sandbox's console context (one per sandbox, so state carries between cells): the
// cells run before are loaded first, a new cell's outputs are shown as they stream in.
import { useEffect, useRef, useState } from "preact/hooks";
import { getJSON, isAdmin, sandboxPath, streamNDJSON } from "../api.js";
import { when } from "../format.js";
import { Output } from "./outputs.jsx";

const LANGUAGES = ["python", "javascript", "typescript", "r", "java", "bash"];

function Cell({ cell, running }) {
  return (
    <article class="cell" aria-label={`Cell ${cell.count ?? ""}`.trim()}>
      <div class="cell-head">
        <span class="prompt">In [{running ? "*" : cell.count ?? " "}]</span>
        <span class="muted small">{cell.language}{cell.at ? ` · ${when(cell.at)}` : ""}</span>
      </div>
      <pre class="cell-code">{cell.code}</pre>
      <div class="cell-outputs">{cell.outputs.map((item) => <Output item={item} />)}</div>
    </article>
  );
}

export function CodeCell({ id }) {
  const [cells, setCells] = useState([]);
  const [code, setCode] = useState("");
  const [language, setLanguage] = useState("python");
  const [running, setRunning] = useState(false);
  const [error, setError] = useState("");
  const abort = useRef(null);
  useEffect(() => {
    getJSON(`${sandboxPath(id)}/code/history`)
      .then((h) => setCells((h.cells || []).map((c) => ({ ...c, count: c.outputs.find((o) => o.type === "end")?.execution_count }))))
      .catch((e) => setError(`Could not load the cells run before: ${e.message}`));
    return () => abort.current?.abort();
  }, [id]);
  const run = async (event) => {
    event?.preventDefault();
    if (!code.trim() || running) return;
    const cell = { code, language, outputs: [], at: Date.now() / 1000 };
    setCells((cs) => [...cs, cell]);
    setRunning(true);
    setError("");
    abort.current = new AbortController();
    const update = () => setCells((cs) => [...cs.slice(0, -1), { ...cell, outputs: [...cell.outputs] }]);
    try {
      await streamNDJSON(`${sandboxPath(id)}/code`, { code, language }, (item) => {
        if (item.type === "end") cell.count = item.execution_count;
        cell.outputs.push(item);
        update();
      }, abort.current.signal);
      setCode("");
    } catch (e) {
      if (e.name !== "AbortError") setError(e.message);
    } finally {
      setRunning(false);
      update();
    }
  };
  const keys = (event) => {
    if (event.key === "Enter" && (event.shiftKey || event.ctrlKey || event.metaKey)) run(event);
  };
  return (
    <div class="code">
      <div class="cells" aria-label="Cells run" role="log">
        {cells.length === 0 && <p class="muted">No cells run from the console yet.</p>}
        {cells.map((cell, i) => <Cell cell={cell} running={running && i === cells.length - 1} />)}
      </div>
      {isAdmin() ? (
        <form class="cell-input" onSubmit={run}>
          <div class="panel-bar">
            <label for="cell-language">Language</label>
            <select id="cell-language" value={language} onChange={(e) => setLanguage(e.currentTarget.value)}>
              {LANGUAGES.map((l) => <option value={l}>{l}</option>)}
            </select>
            <span class="muted small">Shift+Enter runs</span>
          </div>
          <label for="cell-code" class="sr-only">Code</label>
          <textarea id="cell-code" class="mono" rows={6} spellcheck={false} value={code} placeholder="print('hello')"
            onInput={(e) => setCode(e.currentTarget.value)} onKeyDown={keys} />
          <button type="submit" disabled={running || !code.trim()}>{running ? "Running…" : "Run"}</button>
        </form>
      ) : <p class="muted">A read-only session cannot run code.</p>}
      {error && <p class="error" role="alert">{error}</p>}
    </div>
  );
}
