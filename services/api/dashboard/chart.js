// A small line chart on <canvas>: a few named series of (step, value) points, shared axes.
// Our own code (no library): the dashboard ships no third-party assets.

const COLOURS = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c"];

export class LineChart {
  /** A figure with a caption and a legend inside `parent`; `names` are the series it may show. */
  constructor(parent, title, names) {
    this.names = names;
    this.series = new Map(); // name -> Map(step -> value)
    this.figure = document.createElement("figure");
    this.figure.dataset.chart = title;
    const caption = document.createElement("figcaption");
    caption.textContent = title;
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.canvas = document.createElement("canvas");
    this.canvas.dataset.points = "0";
    this.figure.append(caption, this.legend, this.canvas);
    parent.append(this.figure);
    this.pending = false;
  }

  /** Whether `name` belongs to this chart (a name or a RegExp of names). */
  wants(name) {
    return this.names.some((n) => (n instanceof RegExp ? n.test(name) : n === name));
  }

  add(name, step, value) {
    if (value === null || !Number.isFinite(value)) return;
    if (!this.series.has(name)) this.series.set(name, new Map());
    this.series.get(name).set(step, value);
    if (!this.pending) {  // draw once per frame, however many points arrive
      this.pending = true;
      requestAnimationFrame(() => { this.pending = false; this.draw(); });
    }
  }

  points() {
    let count = 0;
    for (const points of this.series.values()) count += points.size;
    return count;
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 360;
    const height = canvas.clientHeight || 180;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    canvas.dataset.points = String(this.points());
    this.figure.dataset.points = canvas.dataset.points;
    const all = [...this.series.values()].flatMap((m) => [...m.entries()]);
    if (all.length === 0) return;
    const [x0, x1] = extent(all.map(([x]) => x));
    const [y0, y1] = extent(all.map(([, y]) => y));
    const pad = { left: 48, right: 8, top: 8, bottom: 20 };
    const sx = (x) => pad.left + ((x - x0) / (x1 - x0 || 1)) * (width - pad.left - pad.right);
    const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0 || 1)) * (height - pad.top - pad.bottom);
    axes(ctx, { x0, x1, y0, y1, sx, sy, width, height, pad });
    this.legend.replaceChildren();
    [...this.series.keys()].sort().forEach((name, i) => {
      const colour = COLOURS[i % COLOURS.length];
      const points = [...this.series.get(name).entries()].sort((a, b) => a[0] - b[0]);
      ctx.strokeStyle = ctx.fillStyle = colour;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      points.forEach(([x, y], j) => (j ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
      ctx.stroke();
      if (points.length === 1) ctx.fillRect(sx(points[0][0]) - 2, sy(points[0][1]) - 2, 4, 4);
      const label = document.createElement("span");
      label.style.color = colour;
      label.textContent = `${name} ${format(points[points.length - 1][1])}`;
      this.legend.append(label);
    });
  }
}

function extent(values) {
  let low = Math.min(...values);
  let high = Math.max(...values);
  if (low === high) { low -= Math.abs(low) * 0.1 || 0.5; high += Math.abs(high) * 0.1 || 0.5; }
  return [low, high];
}

function axes(ctx, { x0, x1, y0, y1, sx, sy, width, height, pad }) {
  ctx.strokeStyle = "#d9dde6";
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    ctx.beginPath();
    ctx.moveTo(pad.left, sy(y));
    ctx.lineTo(width - pad.right, sy(y));
    ctx.stroke();
    ctx.fillText(format(y), 2, sy(y) + 4);
  }
  ctx.fillText(`step ${format(x0)}`, pad.left, height - 4);
  const last = `${format(x1)}`;
  ctx.fillText(last, width - pad.right - ctx.measureText(last).width, height - 4);
}

export function format(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const size = Math.abs(value);
  if (size !== 0 && (size < 1e-3 || size >= 1e5)) return value.toExponential(2);
  return Number.isInteger(value) ? String(value) : value.toFixed(size < 1 ? 3 : 2);
}
