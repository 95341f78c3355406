// The layers of src/ (see LAYERS in .dependency-cruiser.cjs and docs/ARCHITECTURE.md): a
// module imports only from its own folder and the folders below it; type-only imports
// count; tests may reach up; only tests use testing/; no import cycles outside tests.
//
// dependency-cruiser parses the TypeScript sources (not dist/) with @swc/core. swc reports
// `import type`, `import { type X }`, `export type ... from` and a top-level `import('...')`
// type annotation, but not an `import('...')` type nested inside another type (e.g.
// `Promise<import('../a.js').T>`), so those are found textually here and held to the same
// generated rules.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { cruise } from 'dependency-cruiser';
import type { ICruiseOptions, ICruiseResult, IForbiddenRuleType } from 'dependency-cruiser';

type LayerRuleOptions = { root?: string; testOnlyLayer?: string | null; circular?: boolean };
type DepcruiseConfig = {
  forbidden: IForbiddenRuleType[];
  options: ICruiseOptions;
  /** non-enumerable extras of .dependency-cruiser.cjs */
  LAYERS: readonly string[];
  TEST_ONLY_LAYER: string;
  layerRules: (layers: readonly string[], opts?: LayerRuleOptions) => IForbiddenRuleType[];
};

// dist/layers.test.js -> repo root (the same from src/ when run by a TS-aware runner)
const REPO = fileURLToPath(new URL('..', import.meta.url));
const config = createRequire(import.meta.url)(path.join(REPO, '.dependency-cruiser.cjs')) as DepcruiseConfig;
const TEST_FILE = /\.test\.ts$/;

/** Every .ts file under <baseDir>/src, as posix paths relative to baseDir. */
function sourceFiles(baseDir: string): string[] {
  return (fs.readdirSync(path.join(baseDir, 'src'), { recursive: true }) as string[])
    .map((f) => path.posix.join('src', f.split(path.sep).join('/')))
    .filter((f) => f.endsWith('.ts'))
    .sort();
}

type Edge = { from: string; to: string };

/**
 * `import('./x.js')` occurrences in the sources (type positions and dynamic imports alike)
 * whose edge dependency-cruiser did not report: swc misses nested import types.
 */
function missedImportTypeEdges(baseDir: string, files: string[], result: ICruiseResult): Edge[] {
  const seen = new Set(result.modules.flatMap((m) => m.dependencies.map((d) => `${m.source} ${d.resolved}`)));
  const edges: Edge[] = [];
  const re = /\bimport\s*\(\s*(['"])(\.\.?\/[^'"]+)\1\s*\)/g;
  for (const from of files) {
    const text = fs.readFileSync(path.join(baseDir, from), 'utf8');
    for (const m of text.matchAll(re)) {
      const spec = m[2]!;
      const joined = path.posix.join(path.posix.dirname(from), spec);
      const candidates = [joined.replace(/\.js$/, '.ts'), joined];
      const to = candidates.find((c) => fs.existsSync(path.join(baseDir, c))) ?? joined;
      if (!seen.has(`${from} ${to}`)) edges.push({ from, to });
    }
  }
  return edges;
}

const asList = (p: string | string[] | undefined): string[] => (p === undefined ? [] : Array.isArray(p) ? p : [p]);

/** Whether a generated path rule (from.path/pathNot, to.path only) forbids the edge. */
function pathRuleForbids(rule: IForbiddenRuleType, { from, to }: Edge): boolean {
  const r = rule as { from?: { path?: string | string[]; pathNot?: string | string[] }; to?: Record<string, unknown> };
  if (!r.from || !r.to || Object.keys(r.to).some((k) => k !== 'path')) return false;
  const any = (res: string[], s: string) => res.some((re) => new RegExp(re).test(s));
  const fromPath = asList(r.from.path);
  const toPath = asList(r.to.path as string | string[] | undefined);
  return (
    (fromPath.length === 0 || any(fromPath, from)) &&
    !any(asList(r.from.pathNot), from) &&
    (toPath.length === 0 || any(toPath, to))
  );
}

/** Cruise <baseDir>/src with the given rules; every violation as `from -> to (rule)`. */
async function checkLayers(baseDir: string, forbidden: IForbiddenRuleType[]) {
  const files = sourceFiles(baseDir);
  const { output } = await cruise(['src'], {
    ...config.options,
    baseDir,
    validate: true,
    ruleSet: { forbidden },
  });
  assert.ok(typeof output === 'object', 'dependency-cruiser returned a report, not a cruise result');
  const result = output as ICruiseResult;
  const violations = result.summary.violations.map((v) => {
    const cycle = v.cycle?.length ? ` [cycle: ${[v.from, ...v.cycle.map((c) => c.name)].join(' -> ')}]` : '';
    return `${v.from} -> ${v.to} (${v.rule.name})${cycle}`;
  });
  for (const edge of missedImportTypeEdges(baseDir, files, result)) {
    for (const rule of forbidden.filter((r) => pathRuleForbids(r, edge))) {
      violations.push(`${edge.from} -> ${edge.to} (${rule.name}) [inline import type]`);
    }
  }
  return { files, result, violations: [...new Set(violations)].sort() };
}

const layerOf = (source: string): string | undefined => /^src\/([^/]+)\//.exec(source)?.[1];

test('src/ keeps its layers: no upward imports, testing/ only for tests, no cycles', async () => {
  const { files, result, violations } = await checkLayers(REPO, config.forbidden);

  if (violations.length > 0) {
    assert.fail(`${violations.length} layer violation(s) (rules: .dependency-cruiser.cjs):\n  ${violations.join('\n  ')}\n`);
  }

  // ...and the cruise really saw the tree, so a parser that sees nothing cannot pass.
  const cruised = new Set(result.modules.map((m) => m.source));
  assert.ok(files.length > 100, `only ${files.length} .ts files under src/`);
  assert.deepEqual(files.filter((f) => !cruised.has(f)), [], 'files under src/ that dependency-cruiser did not cruise');
  assert.ok(cruised.size > 100, `dependency-cruiser saw only ${cruised.size} modules`);

  const folders = [...new Set(files.map(layerOf).filter((l): l is string => l !== undefined))];
  assert.deepEqual(folders.filter((f) => !config.LAYERS.includes(f)), [], 'folders under src/ missing from LAYERS');

  const depsPerLayer = new Map<string, number>();
  for (const m of result.modules) {
    const layer = layerOf(m.source);
    if (layer && !TEST_FILE.test(m.source)) depsPerLayer.set(layer, (depsPerLayer.get(layer) ?? 0) + m.dependencies.length);
  }
  const codeLayers = config.LAYERS.filter((l) => files.some((f) => layerOf(f) === l && !TEST_FILE.test(f)));
  assert.deepEqual(codeLayers.filter((l) => !depsPerLayer.get(l)), [], 'layers with code but no dependency seen');
  // type-only imports count: strategies/spec.ts imports nothing but types from config/config.ts
  const spec = result.modules.find((m) => m.source === 'src/strategies/spec.ts');
  assert.ok(spec?.dependencies.some((d) => d.resolved === 'src/config/config.ts'), 'a type-only import was not seen: is the swc parser in use?');
  const localDeps = result.modules.flatMap((m) => m.dependencies).filter((d) => d.resolved.startsWith('src/'));
  assert.ok(localDeps.every((d) => d.resolved.endsWith('.ts')), 'a local import resolved to something other than .ts');
  assert.ok(localDeps.length > 300, `only ${localDeps.length} imports between modules of src/`);
});

test('the generated rules catch a lower layer importing an upper one (type-only and inline too)', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'layers-test-'));
  try {
    const files: Record<string, string> = {
      'src/high/h.ts': 'export interface H { x: number }\nexport const h = 1;\n',
      'src/high/fixture.ts': 'export const fixture = 2;\n',
      'src/low/ok.ts': "import { l } from './l.js';\nexport const ok = l;\n",
      'src/low/l.ts': 'export const l = 0;\n',
      'src/low/value.ts': "import { h } from '../high/h.js';\nexport const v = h;\n",
      'src/low/type-only.ts': "import type { H } from '../high/h.js';\nexport const t: H = { x: 1 };\n",
      'src/low/inline-type.ts': "export let p: Promise<import('../high/h.js').H> | undefined;\n",
      'src/low/up.test.ts': "import { h } from '../high/h.js';\nimport { fixture } from '../high/fixture.js';\nexport const u = [h, fixture];\n",
      'src/low/imports-test.ts': "import { u } from './up.test.js';\nexport const w = u;\n",
      'src/low/cycle-a.ts': "import { b } from './cycle-b.js';\nexport const a = (): number => b();\n",
      'src/low/cycle-b.ts': "import { a } from './cycle-a.js';\nexport const b = (): number => a();\n",
      'src/low/missing.ts': "import { gone } from './gone.js';\nexport const m = gone;\n",
      'src/index.ts': "import { fixture } from './high/fixture.js';\nimport { h } from './high/h.js';\nexport { fixture, h };\n",
    };
    for (const [name, text] of Object.entries(files)) {
      fs.mkdirSync(path.join(dir, path.dirname(name)), { recursive: true });
      fs.writeFileSync(path.join(dir, name), text);
    }
    // two layers; 'high' plays the part of testing/ (fixtures for tests only)
    const { violations } = await checkLayers(dir, config.layerRules(['low', 'high'], { testOnlyLayer: 'high' }));
    // dependency-cruiser reports a cycle once, from one of its modules
    const cycles = violations.filter((v) => v.includes('(no-circular)'));
    assert.equal(cycles.length, 1, violations.join('\n'));
    assert.match(cycles[0]!, /^src\/low\/cycle-[ab]\.ts -> src\/low\/cycle-[ab]\.ts \(no-circular\)/);
    assert.deepEqual(violations.filter((v) => !cycles.includes(v)), [
      'src/index.ts -> src/high/fixture.ts (not-to-high-from-non-test)',
      'src/index.ts -> src/high/h.ts (not-to-high-from-non-test)',
      'src/low/imports-test.ts -> src/low/up.test.ts (not-to-test-file)',
      'src/low/inline-type.ts -> src/high/h.ts (layer-low-may-not-import-high) [inline import type]',
      'src/low/missing.ts -> ./gone.js (no-unresolvable-local-import)',
      'src/low/type-only.ts -> src/high/h.ts (layer-low-may-not-import-high)',
      'src/low/value.ts -> src/high/h.ts (layer-low-may-not-import-high)',
    ]);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
