// The sandbox's files: list a directory, go into one, upload into it (admins), download a file.
import { useRef, useState } from "preact/hooks";
import { API, getJSON, isAdmin, request, sandboxPath } from "../api.js";
import { bytes, when } from "../format.js";
import { usePoll } from "../hooks.js";

const HOME = "/home/user";

function parentOf(path) {
  const cut = path.replace(/\/+$/, "").lastIndexOf("/");
  return cut <= 0 ? "/" : path.slice(0, cut);
}

const join = (dir, name) => (dir.endsWith("/") ? dir + name : `${dir}/${name}`);

function Crumbs({ path, go }) {
  const parts = path.split("/").filter(Boolean);
  return (
    <nav class="crumbs" aria-label="Current folder">
      <button type="button" class="link" onClick={() => go("/")}>/</button>
      {parts.map((part, i) => {
        const to = `/${parts.slice(0, i + 1).join("/")}`;
        return (
          <>
            {i > 0 && <span class="sep">/</span>}
            <button type="button" class="link" onClick={() => go(to)} aria-current={i === parts.length - 1 ? "location" : undefined}>{part}</button>
          </>
        );
      })}
    </nav>
  );
}

export function FileBrowser({ id }) {
  const [path, setPath] = useState(HOME);
  const [typed, setTyped] = useState(HOME);
  const [message, setMessage] = useState(null);
  const input = useRef(null);
  const listing = usePoll(() => getJSON(`${sandboxPath(id)}/files?path=${encodeURIComponent(path)}`), 0, [id, path]);
  const go = (to) => {
    setPath(to);
    setTyped(to);
    setMessage(null);
  };
  const upload = async (event) => {
    const files = [...event.currentTarget.files];
    for (const file of files) {
      const target = join(path, file.name);
      try {
        const done = await (await request(`${sandboxPath(id)}/file?path=${encodeURIComponent(target)}`, {
          method: "POST", body: file, headers: { "Content-Type": "application/octet-stream" },
        })).json();
        setMessage({ ok: true, text: `Uploaded ${done.path} (${bytes(done.size)})` });
      } catch (e) {
        setMessage({ ok: false, text: `Upload of ${file.name} failed: ${e.message}` });
      }
    }
    if (input.current) input.current.value = "";
    listing.reload();
  };
  const entries = [...(listing.data?.entries || [])].sort((a, b) =>
    (a.type === "dir" ? 0 : 1) - (b.type === "dir" ? 0 : 1) || a.name.localeCompare(b.name));
  return (
    <div class="files">
      <div class="panel-bar">
        <Crumbs path={path} go={go} />
        <form class="goto" onSubmit={(e) => { e.preventDefault(); go(typed || "/"); }}>
          <input aria-label="Folder path" value={typed} onInput={(e) => setTyped(e.currentTarget.value)} />
          <button type="submit" class="quiet">Open</button>
        </form>
        {isAdmin() && (
          <label class="upload button">
            Upload…
            <input ref={input} type="file" multiple aria-label="Upload a file" onChange={upload} />
          </label>
        )}
      </div>
      {message && <p class={message.ok ? "ok" : "error"} role={message.ok ? "status" : "alert"}>{message.text}</p>}
      {listing.error && <p class="error" role="alert">{listing.error.message}</p>}
      <table class="list compact" aria-label="Files">
        <thead><tr><th>Name</th><th>Size</th><th>Modified</th><th><span class="sr-only">Download</span></th></tr></thead>
        <tbody>
          {path !== "/" && (
            <tr><td colSpan={4}><button type="button" class="link" onClick={() => go(parentOf(path))}>.. (up)</button></td></tr>
          )}
          {entries.map((entry) => (
            <tr key={entry.path} data-file={entry.name}>
              <td>
                {entry.type === "dir"
                  ? <button type="button" class="link" onClick={() => go(entry.path)}>{entry.name}/</button>
                  : <span>{entry.name}{entry.type === "symlink" && <span class="muted small"> (link)</span>}</span>}
              </td>
              <td class="num">{entry.type === "dir" ? "" : bytes(entry.size)}</td>
              <td>{entry.modified ? when(entry.modified) : ""}</td>
              <td>
                {entry.type !== "dir" && (
                  <a href={`${API}${sandboxPath(id)}/file?path=${encodeURIComponent(entry.path)}`} download={entry.name}
                    aria-label={`Download ${entry.name}`}>Download</a>
                )}
              </td>
            </tr>
          ))}
          {listing.data && entries.length === 0 && <tr><td colSpan={4} class="muted">(empty)</td></tr>}
        </tbody>
      </table>
    </div>
  );
}
