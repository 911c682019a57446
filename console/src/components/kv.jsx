// An object as a definition list (nested values as indented JSON): env, metadata, network, limits.

function Value({ value }) {
  if (value === null || value === undefined) return <span class="muted">–</span>;
  if (typeof value === "object") return <pre class="json">{JSON.stringify(value, null, 2)}</pre>;
  return <span class="mono">{String(value)}</span>;
}

export function KeyValues({ object, empty = "none", label }) {
  const entries = Object.entries(object || {});
  if (entries.length === 0) return <p class="muted small">{empty}</p>;
  return (
    <dl class="kv" aria-label={label}>
      {entries.map(([k, v]) => (
        <>
          <dt class="mono">{k}</dt>
          <dd><Value value={v} /></dd>
        </>
      ))}
    </dl>
  );
}
