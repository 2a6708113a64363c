// A spec as JSON, or as the YAML subset the example specs use: block mappings and lists by
// indentation, `# comments`, and scalars (numbers, true/false/null, quoted or plain strings,
// `[a, b]` / `{}` flow collections written as JSON). Anything else is an error, not a guess.

export function parseSpec(text) {
  const trimmed = text.trim();
  if (trimmed.startsWith("{")) return JSON.parse(trimmed);
  const lines = text.split("\n")
    .map((raw) => raw.replace(/\s+#.*$/, "").replace(/^\s*#.*$/, ""))
    .filter((line) => line.trim() !== "")
    .map((line) => ({ indent: line.length - line.trimStart().length, text: line.trim() }));
  const [value, next] = block(lines, 0, lines.length ? lines[0].indent : 0);
  if (next !== lines.length) throw new Error(`unexpected indentation at "${lines[next].text}"`);
  return value;
}

function block(lines, at, indent) {
  const list = lines[at]?.text.startsWith("- ");
  const out = list ? [] : {};
  while (at < lines.length && lines[at].indent === indent) {
    let text = lines[at].text;
    if (list !== text.startsWith("- ")) throw new Error(`mixed list and mapping at "${text}"`);
    if (list) text = text.slice(2).trim();
    const colon = text.search(/:(\s|$)/);
    if (list && colon < 0) { out.push(scalar(text)); at += 1; continue; }
    if (colon < 0) throw new Error(`expected "key: value" at "${text}"`);
    const key = text.slice(0, colon).trim().replace(/^["']|["']$/g, "");
    const rest = text.slice(colon + 1).trim();
    let value;
    if (rest !== "") { value = scalar(rest); at += 1; }
    else if (at + 1 < lines.length && lines[at + 1].indent > indent) [value, at] = block(lines, at + 1, lines[at + 1].indent);
    else { value = null; at += 1; }
    if (list) out.push({ [key]: value }); else out[key] = value;
  }
  return [out, at];
}

function scalar(text) {
  if (/^(true|false|null|~)$/.test(text)) return text === "~" ? null : JSON.parse(text);
  if (/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(text)) return Number(text);
  if (text.startsWith('"') || text.startsWith("[") || text.startsWith("{")) return JSON.parse(text);
  if (text.startsWith("'")) return text.slice(1, -1).replace(/''/g, "'");
  return text;
}
