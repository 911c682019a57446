// A terminal on the sandbox's PTY: xterm.js over the console's WebSocket. Output arrives as binary
// frames; keystrokes go as binary frames; a resize as the text frame {"resize": [cols, rows]}.
import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { useEffect, useRef, useState } from "preact/hooks";
import { API, sandboxPath } from "../api.js";

const encoder = new TextEncoder();

function socketURL(id, cols, rows) {
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${window.location.host}${API}${sandboxPath(id)}/terminal?cols=${cols}&rows=${rows}`;
}

export function TerminalPanel({ id }) {
  const box = useRef(null);
  const [status, setStatus] = useState("connecting");
  const [generation, setGeneration] = useState(0); // a new one reconnects
  useEffect(() => {
    const term = new Terminal({
      cursorBlink: true,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace",
      fontSize: 13,
      scrollback: 5000,
      screenReaderMode: false,
      theme: { background: "#0f172a", foreground: "#e2e8f0", cursor: "#f8fafc" },
    });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(box.current);
    try {
      fit.fit();
    } catch {
      // not laid out yet: the server's default size holds until the first resize
    }
    const ws = new WebSocket(socketURL(id, term.cols, term.rows));
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      setStatus("connected");
      term.focus();
    };
    ws.onmessage = (event) => {
      term.write(typeof event.data === "string" ? event.data : new Uint8Array(event.data));
    };
    ws.onclose = (event) => {
      const why = event.code === 1000 ? "the shell exited" : event.reason || `closed (${event.code})`;
      setStatus(`disconnected: ${why}`);
      term.write(`\r\n\x1b[2m[${why}]\x1b[0m\r\n`);
    };
    const input = term.onData((data) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data));
    });
    const binary = term.onBinary((data) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(Uint8Array.from(data, (c) => c.charCodeAt(0) & 0xff));
    });
    const resized = term.onResize(({ cols, rows }) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ resize: [cols, rows] }));
    });
    const observer = new ResizeObserver(() => {
      try {
        fit.fit();
      } catch {
        // hidden: nothing to fit
      }
    });
    observer.observe(box.current);
    return () => {
      observer.disconnect();
      input.dispose();
      binary.dispose();
      resized.dispose();
      ws.onclose = null;
      ws.close();
      term.dispose();
    };
  }, [id, generation]);
  return (
    <div class="terminal-panel">
      <div class="panel-bar">
        <span role="status" class="muted">Terminal: {status}</span>
        {status.startsWith("disconnected") && (
          <button type="button" class="quiet" onClick={() => { setStatus("connecting"); setGeneration((g) => g + 1); }}>Reconnect</button>
        )}
      </div>
      <div class="terminal-frame">
        <div class="terminal" ref={box} role="region" aria-label="Terminal" />
      </div>
    </div>
  );
}
