// One sandbox: its metrics over its history, its settings (secrets redacted by the server), and — as
// tabs — a terminal, its files and a code cell.
import { useState } from "preact/hooks";
import { control, getJSON, isAdmin, sandboxPath } from "../api.js";
import { SandboxActions } from "../components/actions.jsx";
import { TimeChart } from "../components/charts.jsx";
import { CodeCell } from "../components/codecell.jsx";
import { FileBrowser } from "../components/files.jsx";
import { KeyValues } from "../components/kv.jsx";
import { TerminalPanel } from "../components/terminal.jsx";
import { age, bytes, when } from "../format.js";
import { usePoll } from "../hooks.js";
import { go, href } from "../router.js";

function Overview({ id, detail }) {
  const metrics = usePoll(() => getJSON(control(`${sandboxPath(id)}/metrics`)), 5000, [id]);
  const samples = metrics.data || [];
  const last = samples[samples.length - 1];
  return (
    <div class="overview">
      <div class="charts">
        <TimeChart title="CPU" samples={samples} field="cpuUsedPct" unit="pct" color="#2563eb" />
        <TimeChart title="Memory" samples={samples} field="memUsed" unit="bytes" color="#7c3aed" />
        <TimeChart title="Disk" samples={samples} field="diskUsed" unit="bytes" color="#059669" />
      </div>
      {metrics.error && <p class="error" role="alert">Metrics: {metrics.error.message}</p>}
      {last && <p class="muted small">Last sample {when(last.timestampUnix)}: memory {bytes(last.memUsed)} of {bytes(last.memTotal)}, disk {bytes(last.diskUsed)} of {bytes(last.diskTotal)}.</p>}
      {detail && (
        <div class="grid2">
          <section aria-labelledby="env-title"><h2 id="env-title">Environment</h2>
            <KeyValues object={detail.envVars} label="Environment variables" empty="No environment variables set." /></section>
          <section aria-labelledby="metadata-title"><h2 id="metadata-title">Metadata</h2>
            <KeyValues object={detail.metadata} label="Metadata" empty="No metadata." /></section>
          <section aria-labelledby="network-title"><h2 id="network-title">Network</h2>
            <KeyValues object={detail.network} label="Network settings" empty="Default network settings." /></section>
          <section aria-labelledby="limits-title"><h2 id="limits-title">Limits</h2>
            <KeyValues object={detail.limits} label="Limits" /></section>
          {detail.lifecycle && (
            <section aria-labelledby="lifecycle-title"><h2 id="lifecycle-title">Lifecycle</h2>
              <KeyValues object={detail.lifecycle} label="Lifecycle" /></section>
          )}
          <section aria-labelledby="policy-title" class="wide"><h2 id="policy-title">Policy</h2>
            <KeyValues object={detail.policy} label="Policy" empty="No policy." /></section>
        </div>
      )}
    </div>
  );
}

export function SandboxPage({ id }) {
  const [tab, setTab] = useState("overview");
  const detail = usePoll(() => getJSON(`${sandboxPath(id)}/detail`), 5000, [id]);
  const sandbox = detail.data?.sandbox;
  const tabs = [["overview", "Overview"], ...(isAdmin() ? [["terminal", "Terminal"]] : []), ["files", "Files"], ["code", "Code"]];
  return (
    <section aria-labelledby="sandbox-title">
      <p class="crumb"><a href={href("sandboxes")}>Sandboxes</a> /</p>
      <div class="page-head">
        <h1 id="sandbox-title" class="mono">{id}</h1>
        {sandbox && <span class={`state state-${sandbox.state}`}>{sandbox.state}</span>}
        {sandbox && <span class="muted">{sandbox.alias || sandbox.templateID} · {sandbox.cpuCount} CPU · {sandbox.memoryMB} MiB · up {age(sandbox.startedAt)}</span>}
        <span class="grow" />
        <a class="button quiet" href={href("sandboxes", id, "report")}>Behaviour report</a>
        {sandbox && <SandboxActions sandbox={sandbox} onDone={(what) => (what === "kill" ? go("sandboxes") : detail.reload())} />}
      </div>
      {detail.error && <p class="error" role="alert">{detail.error.status === 404 ? `Sandbox ${id} was not found (it may have ended).` : detail.error.message}</p>}
      <div role="tablist" aria-label="Sandbox views" class="tabs">
        {tabs.map(([name, label]) => (
          <button type="button" role="tab" id={`tab-${name}`} aria-selected={tab === name} aria-controls={`panel-${name}`}
            onClick={() => setTab(name)}>{label}</button>
        ))}
      </div>
      <div role="tabpanel" id={`panel-${tab}`} aria-labelledby={`tab-${tab}`} class="tabpanel">
        {tab === "overview" && <Overview id={id} detail={detail.data} />}
        {tab === "terminal" && <TerminalPanel id={id} />}
        {tab === "files" && <FileBrowser id={id} />}
        {tab === "code" && <CodeCell id={id} />}
      </div>
    </section>
  );
}
