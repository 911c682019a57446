// Builds the console's pages into agentcell/console/static/: one bundled script and one stylesheet with
// hashed names under assets/ (served with Cache-Control: immutable) and the index.html that names them.
// No CDN at run time, no inline script (the pages' CSP forbids both): everything the page loads is here.
import { build } from "esbuild";
import { mkdir, rm, writeFile } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "agentcell", "console", "static");
const assets = join(out, "assets");

await rm(out, { recursive: true, force: true });
await mkdir(assets, { recursive: true });
const result = await build({
  entryPoints: { app: join(here, "src", "main.jsx") },
  bundle: true,
  minify: true,
  sourcemap: false,
  format: "esm",
  target: ["es2022"],
  jsx: "automatic",
  jsxImportSource: "preact",
  outdir: assets,
  entryNames: "[name]-[hash]",
  assetNames: "[name]-[hash]",
  metafile: true,
  legalComments: "linked", // the bundled libraries' licenses, in a file next to the bundle
  logLevel: "warning",
});
const files = Object.keys(result.metafile.outputs).map((p) => basename(p));
const script = files.find((f) => f.endsWith(".js"));
const style = files.find((f) => f.endsWith(".css"));
if (!script || !style) throw new Error(`the build made no script or no stylesheet: ${files.join(", ")}`);
const index = `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>agentcell console</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/ui/assets/${style}">
<script type="module" src="/ui/assets/${script}"></script>
</head>
<body>
<div id="app"><noscript>The agentcell console needs JavaScript.</noscript></div>
</body>
</html>
`;
await writeFile(join(out, "index.html"), index);
console.log(`console built: ${out} (${files.join(", ")})`);
