// An object as a definition list, nested objects as nested lists: env, metadata, network, limits, health.

const isPlain = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isScalar = (v) => v === null || ["string", "number", "boolean"].includes(typeof v);

function Value({ value, depth }) {
  if (value === null || value === undefined) return <span class="muted">–</span>;
  if (Array.isArray(value)) {
    if (value.length === 0) return <span class="muted">none</span>;
    if (value.every(isScalar)) return <span class="mono">{value.map(String).join(", ")}</span>;
    return <pre class="json">{JSON.stringify(value, null, 2)}</pre>;
  }
  if (isPlain(value)) {
    if (Object.keys(value).length === 0) return <span class="muted">none</span>;
    if (depth >= 3) return <pre class="json">{JSON.stringify(value, null, 2)}</pre>;
    return <Entries object={value} depth={depth + 1} />;
  }
  return <span class="mono">{String(value)}</span>;
}

function Entries({ object, depth, label }) {
  return (
    <dl class={depth ? "kv nested" : "kv"} aria-label={label}>
      {Object.entries(object).map(([k, v]) => (
        <>
          <dt class="mono">{k}</dt>
          <dd><Value value={v} depth={depth} /></dd>
        </>
      ))}
    </dl>
  );
}

export function KeyValues({ object, empty = "none", label }) {
  if (!object || Object.keys(object).length === 0) return <p class="muted small">{empty}</p>;
  return <Entries object={object} depth={0} label={label} />;
}
