// Sign-in with the server's API key (or the operator's read-only key): a session cookie comes back.
import { useEffect, useState } from "preact/hooks";
import { getJSON, sendJSON, setSession } from "../api.js";
import { go } from "../router.js";

export function SignInPage({ keyRequired, onKeyRequired, signedIn }) {
  const [key, setKey] = useState("");
  const [error, setError] = useState("");
  const [busy, setBusy] = useState(false);
  useEffect(() => {
    if (signedIn) return;
    getJSON("/session").catch((e) => {
      if (e.body && typeof e.body.keyRequired === "boolean") onKeyRequired(e.body.keyRequired);
    });
  }, [signedIn]);
  const submit = async (event) => {
    event.preventDefault();
    setBusy(true);
    setError("");
    try {
      setSession(await sendJSON("POST", "/session", { apiKey: key }));
      go("sandboxes");
    } catch (e) {
      setError(e.message);
    } finally {
      setBusy(false);
    }
  };
  return (
    <main class="signin">
      <form class="card" onSubmit={submit} aria-labelledby="signin-title">
        <h1 id="signin-title">agentcell console</h1>
        {signedIn && <p>You are signed in as {signedIn.role}. <a href="#/sandboxes">Go to the sandboxes</a>, or sign in with another key.</p>}
        {!keyRequired && (
          <p class="notice" role="status">This server has no API key: any key (even an empty one) signs in as admin.</p>
        )}
        <label for="api-key">API key</label>
        <input id="api-key" name="apiKey" type="password" autocomplete="current-password" value={key}
          onInput={(e) => setKey(e.currentTarget.value)} autofocus />
        <button type="submit" disabled={busy}>{busy ? "Signing in…" : "Sign in"}</button>
        {error && <p class="error" role="alert">{error}</p>}
        <p class="muted small">The server's API key signs in as admin; an operator's read-only key as viewer.</p>
      </form>
    </main>
  );
}
