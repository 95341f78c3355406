/**
 * What the run's configuration checks (config.ts resolveConfig) need to know of each strategy:
 * which of the flags that several strategies share it takes, and whether it is the default.
 * Each strategy's spec declares them (strategies/spec.ts StrategySpec extends
 * {@link StrategyFlags}), and strategies/index.ts registers every spec here when it loads, so
 * that config/, below strategies/ in the layers, names none of them. A caller of resolveConfig
 * loads the strategies first: the library entry (src/index.ts), the CLI, the trainer and the
 * page do by importing strategies/index.ts.
 */

import { LayerwiseError } from '../util/errors.js';

/** A strategy's answers to the configuration checks, declared by its spec. */
export interface StrategyFlags {
  /** The `--strategy` name. */
  readonly name: string;
  /** Whether it is `--strategy`'s default (one registered strategy is). */
  readonly isDefault?: boolean;
  /**
   * Why it refuses data-parallel `--replicas` (e.g. its stages update on their own); absent:
   * it takes them, its update being the whole mini-batch's.
   */
  readonly refusesReplicas?: string;
  /** Why it refuses dynamic loss scaling (a precision policy that scales the loss); absent: it takes it. */
  readonly refusesLossScaling?: string;
  /** Whether it takes `--overlap` (local parallelism's overlapping blocks). */
  readonly overlap?: boolean;
  /**
   * Whether it places a pipeline schedule's stages on its devices itself: the schedules with
   * several stages per device, and `--schedule-file` (gpipe). Else it runs one stage per device.
   */
  readonly placesStages?: boolean;
}

const registered: StrategyFlags[] = [];

/**
 * Registers strategies' flags (strategies/index.ts, at load), in the order they are reported;
 * registering a name again replaces its entry. Throws an Error when two registered strategies
 * claim to be the default.
 */
export function registerStrategies(specs: readonly StrategyFlags[]): void {
  for (const s of specs) {
    const at = registered.findIndex((r) => r.name === s.name);
    if (at >= 0) registered[at] = s;
    else registered.push(s);
  }
  const defaults = registered.filter((s) => s.isDefault);
  if (defaults.length > 1)
    throw new Error(
      `strategies ${defaults.map((s) => s.name).join(', ')} each claim to be the default; one may`,
    );
}

/** The flags of strategy `name`, or undefined for a name no spec registered. */
export function strategyFlagsOf(name: string): StrategyFlags | undefined {
  return registered.find((s) => s.name === name);
}

/** The names of the registered strategies for which `has` holds, in registration order. */
export function strategiesWith(has: (s: StrategyFlags) => boolean): string[] {
  return registered.filter(has).map((s) => s.name);
}

/**
 * Throws {@link LayerwiseError} when no strategy is registered: the strategies were not loaded,
 * so the configuration's checks could not say what any strategy takes.
 */
export function requireStrategies(): void {
  if (registered.length === 0)
    throw new LayerwiseError(
      'no strategy is registered, so the configuration cannot be checked: import strategies/index.js (src/index.ts does) before resolveConfig',
    );
}

/**
 * The `--strategy` a run gets when it names none: the registered one that declares itself the
 * default. Throws {@link LayerwiseError} when none is registered (the strategies were not
 * loaded) or none is the default.
 */
export function defaultStrategy(): string {
  requireStrategies();
  const d = registered.find((s) => s.isDefault);
  if (!d)
    throw new LayerwiseError(
      `none of the strategies ${registered.map((s) => s.name).join(', ')} is the default: give --strategy`,
    );
  return d.name;
}

/** Names as a sentence lists them: `a`, `a and b`, `a, b and c` (`conjunction` 'and' or 'or'). */
export function listNames(
  names: readonly string[],
  conjunction: string,
): string {
  return names.length <= 1
    ? names.join('')
    : `${names.slice(0, -1).join(', ')} ${conjunction} ${names[names.length - 1]}`;
}
