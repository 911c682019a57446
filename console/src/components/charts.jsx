// Charts by uPlot: a small sparkline for the list, a time series for a sandbox's history.
import { useEffect, useRef, useState } from "preact/hooks";
import uPlot from "uplot";
import { bytes } from "../format.js";

// a chart is made only once its element is on screen: a list of 1,000 sandboxes makes a few dozen
function useVisible(ref) {
  const [visible, setVisible] = useState(false);
  useEffect(() => {
    if (!ref.current || visible) return undefined;
    const observer = new IntersectionObserver((entries) => {
      if (entries.some((e) => e.isIntersecting)) setVisible(true);
    }, { rootMargin: "200px" });
    observer.observe(ref.current);
    return () => observer.disconnect();
  }, [visible]);
  return visible;
}

function usePlot(ref, make, data, visible) {
  const plot = useRef(null);
  useEffect(() => {
    if (!visible || !ref.current) return undefined;
    plot.current = make(ref.current);
    return () => {
      plot.current?.destroy();
      plot.current = null;
    };
  }, [visible]);
  useEffect(() => {
    if (plot.current) plot.current.setData(data);
  }, [data]);
}

export function Sparkline({ values, label, color = "#2563eb", max }) {
  const ref = useRef(null);
  const visible = useVisible(ref);
  const ys = values && values.length ? values : [0];
  const data = [ys.map((_, i) => i), ys];
  usePlot(ref, (el) => new uPlot({
    width: 96,
    height: 26,
    class: "spark",
    cursor: { show: false },
    legend: { show: false },
    select: { show: false },
    axes: [{ show: false }, { show: false }],
    scales: { x: { time: false }, y: { range: (_u, lo, hi) => [0, Math.max(max ?? 0, hi, lo + 1)] } },
    series: [{}, { stroke: color, width: 1.5, fill: `${color}22`, points: { show: false } }],
  }, data, el), data, visible);
  const last = values && values.length ? values[values.length - 1] : null;
  return <span class="sparkline" ref={ref} role="img" aria-label={`${label}${last == null ? ": no samples" : ""}`} />;
}

// a sandbox's samples over time: [{timestampUnix, cpuUsedPct, memUsed, memTotal, diskUsed}]
export function TimeChart({ title, samples, field, unit, color }) {
  const ref = useRef(null);
  const visible = useVisible(ref);
  const xs = samples.map((s) => s.timestampUnix);
  const ys = samples.map((s) => s[field]);
  const data = [xs, ys];
  const format = unit === "bytes" ? (v) => bytes(v) : (v) => `${Number(v).toFixed(0)} %`;
  usePlot(ref, (el) => new uPlot({
    width: Math.max(280, el.clientWidth || 420),
    height: 170,
    legend: { show: true, live: true },
    scales: { y: { range: (_u, lo, hi) => [0, Math.max(hi * 1.1, unit === "bytes" ? 1024 * 1024 : 5)] } },
    axes: [{}, { values: (_u, ticks) => ticks.map(format), size: 70 }],
    series: [{}, { label: title, stroke: color, width: 2, fill: `${color}1f`, value: (_u, v) => (v == null ? "–" : format(v)) }],
  }, data, el), data, visible);
  return (
    <figure class="chart">
      <figcaption>{title}</figcaption>
      <div ref={ref} role="img" aria-label={`${title} over time, ${samples.length} samples`} />
    </figure>
  );
}
