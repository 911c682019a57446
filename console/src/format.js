// How numbers and times read on the pages.

export function bytes(n) {
  if (n == null || Number.isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

export function age(since, now = Date.now()) {
  const t = typeof since === "number" ? since * 1000 : Date.parse(since);
  if (!t || Number.isNaN(t)) return "–";
  let s = Math.max(0, Math.round((now - t) / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  s %= 60;
  if (m < 60) return `${m}m ${s}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

export function when(value) {
  const t = typeof value === "number" ? value * 1000 : Date.parse(value);
  if (!t || Number.isNaN(t)) return "–";
  return new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

export const pct = (v) => (v == null ? "–" : `${Number(v).toFixed(1)} %`);

export function duration(seconds) {
  if (seconds == null) return "–";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  return age(Date.now() / 1000 - seconds);
}
