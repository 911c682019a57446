// Hash routes (#/sandboxes/{id}...): the server serves one index.html, the page picks what to show.
import { useEffect, useState } from "preact/hooks";

export function parse(hash) {
  const parts = (hash || "").replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  const [head, id, tail] = parts;
  if (head === "sandboxes" && id && tail === "report") return { page: "report", id };
  if (head === "sandboxes" && id) return { page: "sandbox", id };
  if (["sandboxes", "snapshots", "templates", "health", "signin"].includes(head)) return { page: head };
  return { page: "sandboxes" };
}

export const href = (...parts) => `#/${parts.map(encodeURIComponent).join("/")}`;

export function go(...parts) {
  window.location.hash = href(...parts).slice(1);
}

export function useRoute() {
  const [route, setRoute] = useState(() => parse(window.location.hash));
  useEffect(() => {
    const changed = () => setRoute(parse(window.location.hash));
    window.addEventListener("hashchange", changed);
    return () => window.removeEventListener("hashchange", changed);
  }, []);
  return route;
}
