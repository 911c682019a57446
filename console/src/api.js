// The console's calls to /ui/api (the contract: docs/console.md, "Operating the console"). The session is
// a cookie the browser keeps; every call that changes something carries the CSRF token it came with.

export const API = "/ui/api";

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

// who is signed in: {role, csrf, server} or null; pages read it, sign-in and sign-out set it
export const session = { current: null, listeners: new Set() };

export function setSession(value) {
  session.current = value;
  for (const listener of session.listeners) listener(value);
}

export const isAdmin = () => session.current?.role === "admin";

async function errorOf(response) {
  let body = null;
  let message = `${response.status} ${response.statusText}`;
  try {
    body = await response.json();
    if (body && typeof body.message === "string") message = body.message;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, body);
}

// fetch(API + path) with the session's CSRF token on anything but GET/HEAD; a 401 signs out
export async function request(path, { method = "GET", json, body, headers = {}, signal } = {}) {
  const h = { ...headers };
  if (method !== "GET" && method !== "HEAD" && session.current?.csrf) h["X-CSRF-Token"] = session.current.csrf;
  if (json !== undefined) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(API + path, { method, headers: h, body, signal, credentials: "same-origin" });
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401 && !path.startsWith("/session")) setSession(null);
    throw error;
  }
  return response;
}

export async function getJSON(path, options) {
  const response = await request(path, options);
  return response.status === 204 ? null : response.json();
}

export const sendJSON = (method, path, json) => getJSON(path, { method, json });

// the server's control-plane API through the session (/ui/api/v/...)
export const control = (path) => `/v/${path.replace(/^\//, "")}`;

// NDJSON from a POST, one parsed object per line to onItem as it arrives
export async function streamNDJSON(path, json, onItem, signal) {
  const response = await request(path, { method: "POST", json, signal });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    let newline;
    while ((newline = pending.indexOf("\n")) >= 0) {
      const line = pending.slice(0, newline).trim();
      pending = pending.slice(newline + 1);
      if (line) onItem(JSON.parse(line));
    }
  }
  if (pending.trim()) onItem(JSON.parse(pending));
}

export const sandboxPath = (id) => `/sandboxes/${encodeURIComponent(id)}`;
