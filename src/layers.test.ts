// The layers of src/ (see LAYERS in .dependency-cruiser.cjs and docs/ARCHITECTURE.md): a
// module imports only from its own folder and the folders below it; type-only imports
// count; tests may reach up; only tests use testing/; no import cycles outside tests.
//
// dependency-cruiser cruises the compiled modules in dist/ (one .js per .ts of src/; stale
// outputs of deleted sources are left out). Imports that exist only for types are erased
// from dist/, so they are read from the sources here (`import type`, `export type ... from`,
// `import { type A, type B }`, and `import('...')` types) and held to the same generated
// rules, rooted at src/.

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import { createRequire } from 'node:module';
import * as os from 'node:os';
import * as path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import type {
  ICruiseOptions,
  ICruiseResult,
  IForbiddenRuleType,
} from 'dependency-cruiser';
import { cruise } from 'dependency-cruiser';

type LayerRuleOptions = {
  root?: string;
  testOnlyLayer?: string | null;
  circular?: boolean;
};
type DepcruiseConfig = {
  forbidden: IForbiddenRuleType[];
  options: ICruiseOptions;
  /** non-enumerable extras of .dependency-cruiser.cjs */
  LAYERS: readonly string[];
  TEST_ONLY_LAYER: string;
  layerRules: (
    layers: readonly string[],
    opts?: LayerRuleOptions,
  ) => IForbiddenRuleType[];
};

// dist/layers.test.js -> repo root
const REPO = fileURLToPath(new URL('..', import.meta.url));
const config = createRequire(import.meta.url)(
  path.join(REPO, '.dependency-cruiser.cjs'),
) as DepcruiseConfig;
const TEST_FILE = /\.test\.[jt]s$/;

/** Every .ts file under <baseDir>/src, as posix paths relative to baseDir. */
function sourceFiles(baseDir: string): string[] {
  return (
    fs.readdirSync(path.join(baseDir, 'src'), { recursive: true }) as string[]
  )
    .map((f) => path.posix.join('src', f.split(path.sep).join('/')))
    .filter((f) => f.endsWith('.ts'))
    .sort();
}

/** The compiled module of a source: src/a/b.ts -> dist/a/b.js. */
const compiled = (src: string) =>
  src.replace(/^src\//, 'dist/').replace(/\.ts$/, '.js');

type Edge = { from: string; to: string };

/**
 * The imports of the sources that exist only for types (erased from dist/), as edges between
 * source files: `import type ... from`, `export type ... from`, `import { type A, ... }` where
 * every name is a type, and `import('...')` (a type position or a dynamic import).
 */
function typeOnlyEdges(baseDir: string, files: string[]): Edge[] {
  const edges: Edge[] = [];
  const patterns = [
    /^\s*(?:import|export)\s+type\b[^;]*?\bfrom\s*(['"])(\.\.?\/[^'"]+)\1/gm,
    /\bimport\s*\(\s*(['"])(\.\.?\/[^'"]+)\1\s*\)/g,
  ];
  const named = /^\s*import\s*\{([^}]*)\}\s*from\s*(['"])(\.\.?\/[^'"]+)\2/gm;
  for (const from of files) {
    const text = fs.readFileSync(path.join(baseDir, from), 'utf8');
    const specs = patterns.flatMap((re) =>
      [...text.matchAll(re)].map((m) => m[2]!),
    );
    for (const m of text.matchAll(named)) {
      const names = m[1]!
        .split(',')
        .map((s) => s.trim())
        .filter(Boolean);
      if (names.length > 0 && names.every((n) => n.startsWith('type ')))
        specs.push(m[3]!);
    }
    for (const spec of specs) {
      const joined = path.posix.join(path.posix.dirname(from), spec);
      edges.push({ from, to: joined.replace(/\.js$/, '.ts') });
    }
  }
  return edges;
}

const asList = (p: string | string[] | undefined): string[] =>
  p === undefined ? [] : Array.isArray(p) ? p : [p];

/** Whether a generated path rule (from.path/pathNot, to.path only) forbids the edge. */
function pathRuleForbids(
  rule: IForbiddenRuleType,
  { from, to }: Edge,
): boolean {
  const r = rule as {
    from?: { path?: string | string[]; pathNot?: string | string[] };
    to?: Record<string, unknown>;
  };
  if (!r.from || !r.to || Object.keys(r.to).some((k) => k !== 'path'))
    return false;
  const any = (res: string[], s: string) =>
    res.some((re) => new RegExp(re).test(s));
  const fromPath = asList(r.from.path);
  const toPath = asList(r.to.path as string | string[] | undefined);
  return (
    (fromPath.length === 0 || any(fromPath, from)) &&
    !any(asList(r.from.pathNot), from) &&
    (toPath.length === 0 || any(toPath, to))
  );
}

/**
 * Cruises the compiled modules of <baseDir>/src (in <baseDir>/dist) with the rules for
 * `layers`, and checks the sources' type-only imports against the same rules rooted at src/.
 * Every violation as `from -> to (rule)`.
 */
async function checkLayers(
  baseDir: string,
  layers: readonly string[],
  testOnlyLayer: string | null,
) {
  const files = sourceFiles(baseDir);
  const modules = files
    .map(compiled)
    .filter((f) => fs.existsSync(path.join(baseDir, f)));
  const { output } = await cruise(modules, {
    ...config.options,
    baseDir,
    validate: true,
    ruleSet: {
      forbidden: config.layerRules(layers, { root: 'dist', testOnlyLayer }),
    },
  });
  assert.ok(
    typeof output === 'object',
    'dependency-cruiser returned a report, not a cruise result',
  );
  const result = output as ICruiseResult;
  const violations = result.summary.violations.map((v) => {
    const cycle = v.cycle?.length
      ? ` [cycle: ${[v.from, ...v.cycle.map((c) => c.name)].join(' -> ')}]`
      : '';
    return `${v.from} -> ${v.to} (${v.rule.name})${cycle}`;
  });
  const sourceRules = config.layerRules(layers, {
    root: 'src',
    testOnlyLayer,
    circular: false,
  });
  const typeEdges = typeOnlyEdges(baseDir, files);
  for (const edge of typeEdges) {
    for (const rule of sourceRules.filter((r) => pathRuleForbids(r, edge)))
      violations.push(`${edge.from} -> ${edge.to} (${rule.name}) [type-only]`);
  }
  return {
    files,
    modules,
    result,
    typeEdges,
    violations: [...new Set(violations)].sort(),
  };
}

const layerOf = (source: string): string | undefined =>
  /^(?:src|dist)\/([^/]+)\//.exec(source)?.[1];

test('src/ keeps its layers: no upward imports, testing/ only for tests, no cycles', async () => {
  const { files, modules, result, typeEdges, violations } = await checkLayers(
    REPO,
    config.LAYERS,
    config.TEST_ONLY_LAYER,
  );

  if (violations.length > 0) {
    assert.fail(
      `${violations.length} layer violation(s) (rules: .dependency-cruiser.cjs):\n  ${violations.join('\n  ')}\n`,
    );
  }

  // ...and the cruise really saw the tree, so a setup that sees nothing cannot pass.
  const cruised = new Set(result.modules.map((m) => m.source));
  assert.ok(files.length > 100, `only ${files.length} .ts files under src/`);
  assert.deepEqual(
    files.map(compiled).filter((f) => !cruised.has(f)),
    [],
    'sources whose compiled module dependency-cruiser did not cruise (build first)',
  );
  assert.equal(modules.length, files.length);

  const folders = [
    ...new Set(files.map(layerOf).filter((l): l is string => l !== undefined)),
  ];
  assert.deepEqual(
    folders.filter((f) => !config.LAYERS.includes(f)),
    [],
    'folders under src/ missing from LAYERS',
  );

  const depsPerLayer = new Map<string, number>();
  for (const m of result.modules) {
    const layer = layerOf(m.source);
    if (layer && !TEST_FILE.test(m.source))
      depsPerLayer.set(
        layer,
        (depsPerLayer.get(layer) ?? 0) + m.dependencies.length,
      );
  }
  const codeLayers = config.LAYERS.filter((l) =>
    files.some((f) => layerOf(f) === l && !TEST_FILE.test(f)),
  );
  assert.deepEqual(
    codeLayers.filter((l) => !depsPerLayer.get(l)),
    [],
    'layers with code but no dependency seen',
  );
  // type-only imports are read: strategies/spec.ts imports nothing but types from config/config.ts
  assert.ok(
    typeEdges.some(
      (e) =>
        e.from === 'src/strategies/spec.ts' && e.to === 'src/config/config.ts',
    ),
    'a type-only import was not seen',
  );
  assert.ok(
    typeEdges.length > 50,
    `only ${typeEdges.length} type-only imports seen`,
  );
  const localDeps = result.modules
    .flatMap((m) => m.dependencies)
    .filter((d) => d.resolved.startsWith('dist/'));
  assert.ok(
    localDeps.length > 300,
    `only ${localDeps.length} imports between modules of dist/`,
  );
});

test('the generated rules catch a lower layer importing an upper one (type-only and inline too)', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'layers-test-'));
  try {
    const files: Record<string, string> = {
      'src/high/h.ts':
        'export interface H { x: number }\nexport const h = 1;\n',
      'src/high/fixture.ts': 'export const fixture = 2;\n',
      'src/low/ok.ts': "import { l } from './l.js';\nexport const ok = l;\n",
      'src/low/l.ts': 'export const l = 0;\n',
      'src/low/value.ts':
        "import { h } from '../high/h.js';\nexport const v = h;\n",
      'src/low/type-only.ts':
        "import type { H } from '../high/h.js';\nexport const t: H = { x: 1 };\n",
      'src/low/type-names.ts':
        "import { type H } from '../high/h.js';\nexport const n: H = { x: 2 };\n",
      'src/low/inline-type.ts':
        "export let p: Promise<import('../high/h.js').H> | undefined;\n",
      'src/low/up.test.ts':
        "import { h } from '../high/h.js';\nimport { fixture } from '../high/fixture.js';\nexport const u = [h, fixture];\n",
      'src/low/imports-test.ts':
        "import { u } from './up.test.js';\nexport const w = u;\n",
      'src/low/cycle-a.ts':
        "import { b } from './cycle-b.js';\nexport const a = (): number => b();\n",
      'src/low/cycle-b.ts':
        "import { a } from './cycle-a.js';\nexport const b = (): number => a();\n",
      'src/low/missing.ts':
        "// @ts-nocheck\nimport { gone } from './gone.js';\nexport const m = gone;\n",
      'src/index.ts':
        "import { fixture } from './high/fixture.js';\nimport { h } from './high/h.js';\nexport { fixture, h };\n",
      'tsconfig.json': JSON.stringify({
        compilerOptions: {
          target: 'ES2022',
          module: 'NodeNext',
          moduleResolution: 'NodeNext',
          outDir: 'dist',
          rootDir: 'src',
          skipLibCheck: true,
          types: [],
        },
        include: ['src/**/*.ts'],
      }),
      'package.json': '{"type": "module"}',
    };
    for (const [name, text] of Object.entries(files)) {
      fs.mkdirSync(path.join(dir, path.dirname(name)), { recursive: true });
      fs.writeFileSync(path.join(dir, name), text);
    }
    // compiled as the project is (the same TypeScript), into dist/
    const tsc = spawnSync(
      process.execPath,
      [
        path.join(REPO, 'node_modules', 'typescript', 'bin', 'tsc'),
        '-p',
        path.join(dir, 'tsconfig.json'),
      ],
      { encoding: 'utf8' },
    );
    assert.ok(
      fs.existsSync(path.join(dir, 'dist', 'low', 'value.js')),
      `the fixture did not compile: ${tsc.stdout}${tsc.stderr}`,
    );
    // two layers; 'high' plays the part of testing/ (fixtures for tests only)
    const { violations } = await checkLayers(dir, ['low', 'high'], 'high');
    // dependency-cruiser reports a cycle once, from one of its modules
    const cycles = violations.filter((v) => v.includes('(no-circular)'));
    assert.equal(cycles.length, 1, violations.join('\n'));
    assert.match(
      cycles[0]!,
      /^dist\/low\/cycle-[ab]\.js -> dist\/low\/cycle-[ab]\.js \(no-circular\)/,
    );
    assert.deepEqual(
      violations.filter((v) => !cycles.includes(v)),
      [
        'dist/index.js -> dist/high/fixture.js (not-to-high-from-non-test)',
        'dist/index.js -> dist/high/h.js (not-to-high-from-non-test)',
        'dist/low/imports-test.js -> dist/low/up.test.js (not-to-test-file)',
        'dist/low/missing.js -> ./gone.js (no-unresolvable-local-import)',
        'dist/low/value.js -> dist/high/h.js (layer-low-may-not-import-high)',
        'src/low/inline-type.ts -> src/high/h.ts (layer-low-may-not-import-high) [type-only]',
        'src/low/type-names.ts -> src/high/h.ts (layer-low-may-not-import-high) [type-only]',
        'src/low/type-only.ts -> src/high/h.ts (layer-low-may-not-import-high) [type-only]',
      ],
    );
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
