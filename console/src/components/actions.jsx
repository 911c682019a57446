// Kill / pause / resume of one sandbox (admins only: a viewer's page has none of these buttons).
import { useState } from "preact/hooks";
import { control, isAdmin, request, sandboxPath } from "../api.js";

export function SandboxActions({ sandbox, onDone }) {
  const [busy, setBusy] = useState("");
  const [error, setError] = useState("");
  if (!isAdmin()) return null;
  const id = sandbox.sandboxID;
  const act = async (what, method, suffix, body) => {
    setBusy(what);
    setError("");
    try {
      await request(control(sandboxPath(id) + suffix), { method, json: body });
      onDone?.(what);
    } catch (e) {
      setError(e.message);
    } finally {
      setBusy("");
    }
  };
  return (
    <span class="actions">
      {sandbox.state === "paused" ? (
        <button type="button" class="quiet" disabled={!!busy} aria-label={`Resume sandbox ${id}`}
          onClick={() => act("resume", "POST", "/resume", {})}>{busy === "resume" ? "Resuming…" : "Resume"}</button>
      ) : (
        <button type="button" class="quiet" disabled={!!busy} aria-label={`Pause sandbox ${id}`}
          onClick={() => act("pause", "POST", "/pause", {})}>{busy === "pause" ? "Pausing…" : "Pause"}</button>
      )}
      <button type="button" class="danger" disabled={!!busy} aria-label={`Kill sandbox ${id}`}
        onClick={() => act("kill", "DELETE", "")}>{busy === "kill" ? "Killing…" : "Kill"}</button>
      {error && <span class="error" role="alert">{error}</span>}
    </span>
  );
}
