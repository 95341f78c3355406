// @ts-check
/**
 * Layer rules for the folders of src/ (dependency-cruiser 17).
 *
 * The layers, bottom to top. A module in src/<layer>/ may import only from its
 * own folder and from the layers listed BEFORE it. src/index.ts (the library
 * entry, a top-level file) may import any layer. Test files (*.test.ts) are
 * exempt on the importing side. No non-test module outside src/testing/ may
 * import src/testing/ (fixtures for tests only) or a test file.
 *
 * dependency-cruiser reads the compiled JavaScript in dist/ (the same folders
 * as src/, one .js per .ts), because TypeScript 7 has no JS compiler API for its
 * TypeScript parser and @swc/core cannot be installed from this project's
 * registry on every platform. Imports that exist only for types are erased from
 * dist/, so src/layers.test.ts checks those in the sources against the same
 * rules (rooted at src/).
 *
 * Held by src/layers.test.ts (part of `npm test`). By hand, after a build:
 *   npm run layers     (npx depcruise dist --config .dependency-cruiser.cjs)
 */

/** Bottom to top; written once, rules are generated from it. */
const LAYERS = [
  "util",
  "backend",
  "data",
  "model",
  "optim",
  "schedule",
  "partition",
  "param-server",
  "pipeline",
  "cost",
  "runtime",
  "config",
  "strategies",
  "plan",
  "train",
  "cli",
  "bench",
  "testing",
];

/** Folder that holds only test fixtures (must be a member of LAYERS). */
const TEST_ONLY_LAYER = "testing";

const TEST_FILE = "\\.test\\.[jt]s$";

/** @param {string} s */
const escapeRegExp = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

/**
 * The forbidden rules for an ordered layer list, rooted at `root` (a path
 * relative to the cruise's baseDir: "dist" for the compiled modules, "src" for
 * the type-only imports of the sources).
 *
 * - one rule per (lower, upper) pair: `layer-<lower>-may-not-import-<upper>`,
 *   from non-test modules in root/<lower>/ to anything in root/<upper>/;
 * - `not-to-<testOnly>-from-non-test`: modules that are neither tests nor in
 *   root/<testOnly>/ nor in a layer (where the pair rules already speak:
 *   in practice the top-level files such as src/index.ts) may not import
 *   root/<testOnly>/;
 * - `not-to-test-file`: non-test modules may not import *.test.ts;
 * - `no-unresolvable-local-import`: a relative import that does not resolve to
 *   a file (e.g. a .js specifier with no .ts beside it) fails, so that no
 *   dependency escapes the layer rules by not being resolved;
 * - optionally `no-circular` between non-test modules.
 *
 * @param {readonly string[]} layers bottom to top
 * @param {{ root?: string, testOnlyLayer?: string | null, circular?: boolean }} [opts]
 * @returns {import("dependency-cruiser").IForbiddenRuleType[]}
 */
function layerRules(layers, opts = {}) {
  const root = escapeRegExp(opts.root ?? "dist");
  const testOnly = opts.testOnlyLayer === undefined ? TEST_ONLY_LAYER : opts.testOnlyLayer;
  const circular = opts.circular ?? true;
  const dir = (/** @type {string} */ layer) => `^${root}/${escapeRegExp(layer)}/`;

  /** @type {import("dependency-cruiser").IForbiddenRuleType[]} */
  const rules = [];
  layers.forEach((lower, i) => {
    for (const upper of layers.slice(i + 1)) {
      rules.push({
        name: `layer-${lower}-may-not-import-${upper}`,
        comment: `${lower} is below ${upper} in LAYERS (.dependency-cruiser.cjs); only tests may import upward`,
        severity: "error",
        from: { path: dir(lower), pathNot: TEST_FILE },
        to: { path: dir(upper) },
      });
    }
  });
  if (testOnly !== null) {
    const layerAlternation = layers.map(escapeRegExp).join("|");
    rules.push({
      name: `not-to-${testOnly}-from-non-test`,
      comment: `${root}/${testOnly}/ holds fixtures for tests only`,
      severity: "error",
      // modules in a layer are covered by the pair rules (testing is the top layer)
      from: { pathNot: [TEST_FILE, `^${root}/(${layerAlternation})/`] },
      to: { path: dir(testOnly) },
    });
  }
  rules.push(
    {
      name: "not-to-test-file",
      comment: "only tests may import a test file",
      severity: "error",
      from: { pathNot: TEST_FILE },
      to: { path: TEST_FILE },
    },
    {
      name: "no-unresolvable-local-import",
      comment: "a relative import that does not resolve would escape the layer rules",
      severity: "error",
      from: { path: `^${root}/` },
      to: { couldNotResolve: true, path: "^\\.\\.?/" },
    },
  );
  if (circular) {
    rules.push({
      name: "no-circular",
      comment: "no import cycles between non-test modules",
      severity: "error",
      from: { pathNot: TEST_FILE },
      to: { circular: true },
    });
  }
  return rules;
}

/** Cruise options shared by the CLI and src/layers.test.ts. */
const options = {
  doNotFollow: { path: "node_modules" },
  exclude: { path: "(^|/)node_modules/|\\.d\\.ts$|\\.map$" },
  moduleSystems: /** @type {("es6" | "cjs")[]} */ (["es6", "cjs"]),
  skipAnalysisNotInRules: true,
};

/** @type {import("dependency-cruiser").IConfiguration} */
const config = {
  forbidden: layerRules(LAYERS),
  options,
};

// Non-enumerable, so dependency-cruiser's schema check (which forbids unknown
// top-level keys) does not see them; the test reads them.
Object.defineProperties(config, {
  LAYERS: { value: LAYERS, enumerable: false },
  TEST_ONLY_LAYER: { value: TEST_ONLY_LAYER, enumerable: false },
  layerRules: { value: layerRules, enumerable: false },
});

module.exports = config;
