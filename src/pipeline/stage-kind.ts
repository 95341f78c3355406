/**
 * Stage kinds as plug-ins: a strategy names the module of its stage kind, and each device
 * worker loads that module itself and creates its stage from it, so the runtime knows no stage
 * kind by name. A stage-kind module exports {@link CreateStage} as `createStage`:
 * pipeline/stage.ts (backprop), pipeline/local-stage.ts (local parallelism),
 * pipeline/relay-stage.ts (L2L relay).
 */

import type { HostParams } from '../model/init.js';
import type { Model } from '../model/model.js';
import type { OptimizerConfig } from '../optim/optimizer.js';
import type { StageRange } from '../partition/balance.js';
import { CORE_OPS, declarationOf } from '../schedule/ops.js';
import { LayerwiseError } from '../util/errors.js';
import type { StageProgram } from './executor.js';

/** What every stage is created from, on its device. */
export interface StageContext {
  /** Stage index in the pipeline. */
  index: number;
  /** The whole model (every device builds it from the same config). */
  model: Model;
  /** This stage's blocks [from, to). */
  range: StageRange;
  /** Initial values of this stage's parameters, by key (empty where they live elsewhere). */
  params: HostParams;
  optimizer: OptimizerConfig;
}

/** Creates a stage of one kind; `options` are the kind's own (sent by the strategy, structured-cloned). */
export type CreateStage = (ctx: StageContext, options: unknown) => StageProgram;

/**
 * A stage kind as a strategy names it: `module` is the path of the module under the package's
 * compiled root (e.g. 'pipeline/local-stage.js'), `options` whatever that kind needs.
 */
export interface StageKindRef {
  module: string;
  options?: unknown;
}

/** Stage kinds registered in this thread, by module path (see {@link registerStageKind}). */
const REGISTERED = new Map<string, CreateStage>();

/**
 * Registers the stage kind of module path `module` (e.g. 'pipeline/stage.js') in this thread,
 * so that {@link loadStageKind} returns `create` without importing the module: for bundles
 * (the browser's Web Worker devices, web/device-worker.ts), where there is no module tree to
 * import from at run time.
 */
export function registerStageKind(module: string, create: CreateStage): void {
  REGISTERED.set(module, create);
}

/**
 * Checks a stage kind's handler table against the op declarations (schedule/ops.ts): every op
 * it handles is declared, and is compute (the executor's core runs communication). Throws an
 * Error naming the kind and the op otherwise. Returns the program.
 */
export function checkHandlers<P extends StageProgram>(program: P): P {
  for (const op of Object.keys(program.handlers)) {
    declarationOf(op); // throws for an op nobody declared
    if ((CORE_OPS as readonly string[]).includes(op))
      throw new Error(
        `a ${program.kind} handles '${op}', which the executor's core runs (communication)`,
      );
  }
  return program;
}

/**
 * Loads the stage kind `ref` names (registered, else imported); the stages it creates have their
 * handler tables checked ({@link checkHandlers}). Throws {@link LayerwiseError} for a module path outside the
 * package (absolute, with `..`, or not a .js file) and Error when the module has no `createStage`.
 */
export async function loadStageKind(ref: StageKindRef): Promise<CreateStage> {
  if (!/^[a-z0-9-]+(\/[a-z0-9-]+)*\.js$/.test(ref.module)) {
    throw new LayerwiseError(
      `stage kind module '${ref.module}' must be a path under the package such as 'pipeline/stage.js'`,
    );
  }
  const registered = REGISTERED.get(ref.module);
  if (registered)
    return (ctx, options) => checkHandlers(registered(ctx, options));
  const mod = (await import(
    new URL(`../${ref.module}`, import.meta.url).href
  )) as { createStage?: CreateStage };
  if (typeof mod.createStage !== 'function')
    throw new Error(
      `stage kind module '${ref.module}' exports no createStage function`,
    );
  const create = mod.createStage;
  return (ctx, options) => checkHandlers(create(ctx, options));
}
