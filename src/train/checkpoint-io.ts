/**
 * The one checkpoint format: a folder with
 *   meta.json      format/version, step, training and model config, vocabulary, data position,
 *                  the index of every array, and the size and SHA-256 of each binary file;
 *   params.bin     every parameter, fp32 little-endian, in index order;
 *   optimizer.bin  every optimizer slot (momentum, Adam m and v), fp32, in index order.
 * Parameters and optimizer state are keyed by parameter key (`<block>.<name>`), so a checkpoint
 * is independent of the strategy and partition that wrote it. Every read is validated and a bad
 * checkpoint raises a {@link LayerwiseError} that names the file and the problem.
 *
 * A run folder keeps its checkpoints crash-safely ({@link saveRunCheckpoint}):
 *   checkpoints/step-<N>/   one folder per checkpoint, written as `step-<N>.tmp-<pid>`, fsynced,
 *                           then renamed into place;
 *   checkpoints/latest.json the pointer `{"step": N, "dir": "step-<N>"}`, switched by one atomic
 *                           rename (fsynced) once the new folder is complete; the previous
 *                           checkpoint is removed only after the switch.
 * Whatever instant the process dies, the run folder holds at least the previous complete
 * checkpoint; {@link findCheckpoint} takes the newest one whose files match their checksums and
 * {@link cleanCheckpoints} removes what the crash left behind. Runs of earlier versions kept a
 * plain `checkpoint/` folder (replaced via `checkpoint.tmp-*` and `checkpoint.old-*`): still read.
 */

import { createHash } from 'node:crypto';
import {
  existsSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
} from 'node:fs';
import {
  mkdir,
  open,
  readFile,
  rename,
  rm,
  stat,
  writeFile,
} from 'node:fs/promises';
import { join, relative, resolve } from 'node:path';
import { paramKey, sizeOf } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import { loadModel, type Model, type ModelConfig } from '../model/model.js';
import type { LossScaleState } from '../optim/loss-scale.js';
import type { OptimizerState } from '../optim/optimizer.js';
import { LayerwiseError } from '../util/errors.js';
import { atomicLeftovers, replaceDirAtomic } from '../util/fsx.js';
import { LOCK_DIR, LOCK_OWNER } from './run-folder.js';

export const CHECKPOINT_FORMAT = 'layerwise-checkpoint';
export const CHECKPOINT_VERSION = 1;

interface ArrayEntry {
  key: string;
  slot?: string;
  shape: number[];
  offset: number;
  length: number;
}

interface FileInfo {
  bytes: number;
  sha256: string;
}

/** Everything a checkpoint holds besides the arrays. */
export interface CheckpointMeta {
  step: number;
  /** The training configuration that produced it (see config/config.ts), as JSON. */
  config: Record<string, unknown>;
  model: ModelConfig;
  /** Character vocabulary (text models), as Vocab.toJSON(). */
  vocab: unknown;
  /** Data position (BatcherState), as JSON. */
  data: unknown;
  /** Run statistics carried across resumes: first loss of the run, wall seconds so far, and f16's loss scaler (optim/loss-scale.ts). */
  stats: { initialLoss?: number; wallS: number; lossScale?: LossScaleState };
}

/** A loaded checkpoint. */
export interface Checkpoint extends CheckpointMeta {
  params: HostParams;
  optimizer: OptimizerState;
}

function pack(
  arrays: Array<{
    entry: Omit<ArrayEntry, 'offset' | 'length'>;
    values: Float32Array;
  }>,
): { bin: Uint8Array; index: ArrayEntry[] } {
  const total = arrays.reduce((s, a) => s + a.values.length, 0);
  const all = new Float32Array(total);
  const index: ArrayEntry[] = [];
  let off = 0;
  for (const a of arrays) {
    all.set(a.values, off);
    index.push({ ...a.entry, offset: off, length: a.values.length });
    off += a.values.length;
  }
  return { bin: new Uint8Array(all.buffer), index };
}

function info(bin: Uint8Array): FileInfo {
  return {
    bytes: bin.byteLength,
    sha256: createHash('sha256').update(bin).digest('hex'),
  };
}

/** The files of checkpoint `ck`: name -> bytes (meta.json last: it names the others' checksums). */
async function checkpointFiles(
  ck: Checkpoint,
): Promise<Array<[string, Uint8Array | string]>> {
  const model = await loadModel(ck.model);
  const paramArrays = model.blocks.flatMap((b, bi) =>
    b.params.map((spec) => {
      const key = paramKey(bi, spec.name);
      const values = ck.params.get(key);
      if (!values) throw new Error(`checkpoint: no value for parameter ${key}`);
      return { entry: { key, shape: spec.shape }, values };
    }),
  );
  // parameters outside the model's blocks (auxiliary heads of local parallelism), by key
  const blockKeys = new Set(paramArrays.map((a) => a.entry.key));
  for (const [key, values] of [...ck.params].sort(([a], [b]) =>
    a.localeCompare(b),
  )) {
    if (!blockKeys.has(key))
      paramArrays.push({ entry: { key, shape: [values.length] }, values });
  }
  const slotArrays = Object.entries(ck.optimizer.slots)
    .sort(([a], [b]) => a.localeCompare(b))
    .flatMap(([key, slots]) =>
      Object.entries(slots)
        .sort(([a], [b]) => a.localeCompare(b))
        .map(([slot, values]) => ({
          entry: { key, slot, shape: [values.length] },
          values,
        })),
    );
  const p = pack(paramArrays);
  const o = pack(slotArrays);
  const meta = {
    format: CHECKPOINT_FORMAT,
    version: CHECKPOINT_VERSION,
    step: ck.step,
    config: ck.config,
    model: ck.model,
    vocab: ck.vocab,
    data: ck.data,
    stats: ck.stats,
    params: p.index,
    optimizer: { step: ck.optimizer.step, slots: o.index },
    files: { 'params.bin': info(p.bin), 'optimizer.bin': info(o.bin) },
  };
  return [
    ['params.bin', p.bin],
    ['optimizer.bin', o.bin],
    ['meta.json', JSON.stringify(meta, null, 1)],
  ];
}

/**
 * Writes a stand-alone checkpoint folder at `dir` atomically (temp folder + rename), replacing
 * any previous one. Runs save with {@link saveRunCheckpoint}.
 */
export async function saveCheckpoint(
  dir: string,
  ck: Checkpoint,
): Promise<void> {
  const files = await checkpointFiles(ck);
  await replaceDirAtomic(dir, async (tmp) => {
    for (const [name, data] of files) await writeFile(join(tmp, name), data);
  });
}

/** The run folder's checkpoints (see the module comment). */
export const CHECKPOINTS = 'checkpoints';
/** The pointer file inside {@link CHECKPOINTS}. */
export const POINTER = 'latest.json';
/** Earlier versions' single checkpoint folder. */
export const OLD_CHECKPOINT = 'checkpoint';

/*
 * Test-only fault injection: with LAYERWISE_TEST_KILL_AFTER_FS_CHANGES=N the process SIGKILLs
 * itself right after the Nth file-system change (mkdir, file written, rename, removal) made by
 * the checkpoint code, so that tests can stop a real run at every point of its saves.
 */
let fsChanges = 0;
const killAfter = Number(process.env.LAYERWISE_TEST_KILL_AFTER_FS_CHANGES ?? 0);
/** The signal sent (LAYERWISE_TEST_KILL_SIGNAL, default SIGKILL). */
const killSignal = (process.env.LAYERWISE_TEST_KILL_SIGNAL ??
  'SIGKILL') as NodeJS.Signals;
function changed(): void {
  fsChanges++;
  if (killAfter > 0 && fsChanges === killAfter)
    process.kill(process.pid, killSignal);
}

/** Temporary paths of a save in progress: removed if the process is told to stop (see {@link removeSaveLeftovers}). */
const inProgress = new Set<string>();

/**
 * Removes the temporary files and folders of a save in progress, synchronously (for a SIGTERM
 * or SIGINT handler: the process exits right after). The checkpoint before it stays the latest.
 */
export function removeSaveLeftovers(): void {
  const sleep = (ms: number) =>
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
  for (const p of inProgress) {
    // the save's own write may be creating a file in the folder (ENOTEMPTY), or the file itself
    // (the pointer's temporary), on libuv's thread pool right now: each try removes what is
    // there, and the path counts as gone once it stayed absent 5 ms after the last removal
    for (let tries = 0; tries < 50; tries++) {
      try {
        rmSync(p, { recursive: true, force: true });
        sleep(5);
        if (!existsSync(p)) break;
      } catch {
        sleep(5);
      }
    }
  }
  inProgress.clear();
}

async function fsyncPath(path: string): Promise<void> {
  const fh = await open(path, 'r');
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

async function writeSynced(
  path: string,
  data: Uint8Array | string,
): Promise<void> {
  const fh = await open(path, 'w');
  try {
    await fh.writeFile(data);
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** The step a `step-<N>` folder name holds, or undefined for any other name. */
function stepOfName(name: string): number | undefined {
  const m = /^step-(\d+)$/.exec(name);
  return m ? Number(m[1]) : undefined;
}

function readPointer(out: string): { step: number; dir: string } | undefined {
  try {
    const p = JSON.parse(readFileSync(join(out, CHECKPOINTS, POINTER), 'utf8'));
    return typeof p.dir === 'string' && stepOfName(p.dir) !== undefined
      ? p
      : undefined;
  } catch {
    return undefined;
  }
}

async function switchPointer(
  out: string,
  name: string,
  step: number,
): Promise<void> {
  const root = join(out, CHECKPOINTS);
  const tmp = join(root, `${POINTER}.tmp-${process.pid}`);
  inProgress.add(tmp);
  await writeSynced(tmp, `${JSON.stringify({ step, dir: name })}\n`);
  changed();
  await rename(tmp, join(root, POINTER));
  inProgress.delete(tmp);
  changed();
  await fsyncPath(root);
}

/**
 * Saves checkpoint `ck` into run folder `out` crash-safely (see the module comment): the new
 * folder is written and fsynced under a temporary name, renamed into `checkpoints/step-<N>`, the
 * pointer is switched to it by one atomic rename, and only then are older checkpoints (and an
 * earlier version's `checkpoint/` folder) removed. Returns the new checkpoint's folder.
 */
export async function saveRunCheckpoint(
  out: string,
  ck: Checkpoint,
): Promise<string> {
  const files = await checkpointFiles(ck);
  const root = join(out, CHECKPOINTS);
  if (!existsSync(root)) {
    await mkdir(root, { recursive: true });
    changed();
    await fsyncPath(out);
  }
  const name = `step-${ck.step}`;
  const final = join(root, name);
  const tmp = join(root, `${name}.tmp-${process.pid}`);
  inProgress.add(tmp);
  await rm(tmp, { recursive: true, force: true });
  await mkdir(tmp);
  changed();
  for (const [file, data] of files) {
    await writeSynced(join(tmp, file), data);
    changed();
  }
  await fsyncPath(tmp);
  if (existsSync(final)) {
    // a folder of this step left by an earlier attempt that found it incomplete: never the pointer's
    await rm(final, { recursive: true, force: true });
    changed();
  }
  await rename(tmp, final);
  inProgress.delete(tmp);
  changed();
  await fsyncPath(root);
  await switchPointer(out, name, ck.step);
  await removeOthers(out, final);
  return final;
}

/** Removes every checkpoint and leftover of run folder `out` except the folder `keep`. */
async function removeOthers(out: string, keep: string): Promise<string[]> {
  const removed: string[] = [];
  const root = join(out, CHECKPOINTS);
  const gone = async (p: string) => {
    if (resolve(p) === resolve(keep)) return;
    await rm(p, { recursive: true, force: true });
    removed.push(p);
    changed();
  };
  let names: string[] = [];
  try {
    names = readdirSync(root);
  } catch {
    // no checkpoints folder
  }
  for (const n of names.sort()) if (n !== POINTER) await gone(join(root, n));
  for (const n of readdirSync(out).sort())
    if (
      n === OLD_CHECKPOINT ||
      n.startsWith(`${OLD_CHECKPOINT}.tmp-`) ||
      n.startsWith(`${OLD_CHECKPOINT}.old-`)
    )
      await gone(join(out, n));
  return removed;
}

/** Whether run folder `out` holds a checkpoint (complete or not yet verified): any candidate {@link findCheckpoint} would try. */
export function hasCheckpoint(out: string): boolean {
  return candidates(out).length > 0;
}

interface Candidate {
  dir: string;
  step: number;
  /** The pointer names it. */
  current: boolean;
}

/** The checkpoint folders of run folder `out`, newest first (the pointer's first among equals). */
function candidates(out: string): Candidate[] {
  const list: Candidate[] = [];
  const ptr = readPointer(out);
  try {
    for (const n of readdirSync(join(out, CHECKPOINTS))) {
      const step = stepOfName(n);
      if (step !== undefined)
        list.push({
          dir: join(out, CHECKPOINTS, n),
          step,
          current: ptr?.dir === n,
        });
    }
  } catch {
    // none
  }
  let names: string[] = [];
  try {
    names = readdirSync(out);
  } catch {
    // not a folder
  }
  for (const n of names) {
    if (n !== OLD_CHECKPOINT && !n.startsWith(`${OLD_CHECKPOINT}.old-`))
      continue;
    const dir = join(out, n);
    let step = -1;
    try {
      step = Number(
        JSON.parse(readFileSync(join(dir, 'meta.json'), 'utf8')).step,
      );
    } catch {
      // unreadable: tried last, its error is reported if nothing else loads
    }
    list.push({
      dir,
      step: Number.isFinite(step) ? step : -1,
      current: n === OLD_CHECKPOINT,
    });
  }
  return list.sort(
    (a, b) => b.step - a.step || Number(b.current) - Number(a.current),
  );
}

/** The files a run folder holds once a run has done a step in it. */
const RUN_FILES = [
  'metrics.jsonl',
  'summary.json',
  CHECKPOINTS,
  OLD_CHECKPOINT,
];

/** Whether `out` holds (part of) a run that did a step: its metrics, summary or checkpoints. */
export function holdsRun(out: string): boolean {
  return RUN_FILES.some((f) => existsSync(join(out, f)));
}

/**
 * Whether `out` holds a run that stopped before it did a step: its lock (`.lock`,
 * `.lock-owner.json`, left by a killed run) or its `run.json`, perhaps still the temporary
 * file of a write that was killed before its rename.
 */
export function startedRun(out: string): boolean {
  return (
    existsSync(join(out, 'run.json')) ||
    existsSync(join(out, LOCK_OWNER)) ||
    existsSync(join(out, LOCK_DIR)) ||
    atomicLeftovers(join(out, 'run.json')).length > 0
  );
}

/** Quotes `arg` for a POSIX shell when it needs it. */
function shellQuote(arg: string): string {
  return /^[\w@%+=:,./-]+$/.test(arg)
    ? arg
    : `'${arg.replaceAll("'", "'\\''")}'`;
}

/** The shell command `layerwise <argv> --overwrite`: what starts a run of those arguments again. */
export function startAgainCommand(argv: readonly string[]): string {
  return [
    'layerwise',
    ...argv.filter((a) => a !== '--overwrite'),
    '--overwrite',
  ]
    .map(shellQuote)
    .join(' ');
}

/** The argv a run.json (or its temporary file) at `path` holds, or undefined. */
function savedArgv(path: string): string[] | undefined {
  try {
    const r = JSON.parse(readFileSync(path, 'utf8')) as { argv?: unknown };
    return Array.isArray(r.argv) && r.argv.every((a) => typeof a === 'string')
      ? (r.argv as string[])
      : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The command that starts the run in `out` again (from run.json, else from the temporary file
 * of a run.json write that was killed before its rename), or undefined.
 */
export function restartCommand(out: string): string | undefined {
  const path = join(out, 'run.json');
  for (const p of [path, ...atomicLeftovers(path)]) {
    const argv = savedArgv(p);
    if (argv) return startAgainCommand(argv);
  }
  return undefined;
}

/** What to do when the command that started a run is not recoverable (no run.json, or an empty one). */
export const NO_COMMAND =
  "its command was not saved: run your original 'layerwise train' command again with the same --out (add --overwrite if it refuses the folder)";

/** A found checkpoint: its folder and contents. */
export interface FoundCheckpoint {
  dir: string;
  ck: Checkpoint;
  /** The run folder it belongs to (undefined when a checkpoint folder was given directly). */
  run?: string;
}

/**
 * Finds and loads the newest complete checkpoint of `path`: a run folder (newest `step-<N>`
 * folder whose files match their checksums; an earlier version's `checkpoint/` and its
 * `checkpoint.old-*` too) or a checkpoint folder itself. Writes nothing. Throws
 * {@link LayerwiseError} when the path is missing or a file, when no checkpoint is complete yet
 * (naming the command that starts the run again), or with the newest candidate's problem when
 * none of them loads.
 */
export async function findCheckpoint(path: string): Promise<FoundCheckpoint> {
  let st: ReturnType<typeof statSync> | undefined;
  try {
    st = statSync(path);
  } catch {
    throw new LayerwiseError(
      `run folder ${path} does not exist; give the --out folder of an earlier 'layerwise train' run`,
    );
  }
  if (!st.isDirectory())
    throw new LayerwiseError(
      `${path} is a file, not a run folder; give the --out folder of an earlier 'layerwise train' run (or its checkpoint folder)`,
    );
  if (existsSync(join(path, 'meta.json')))
    return { dir: path, ck: await loadCheckpoint(path) };
  const list = candidates(path);
  let first: unknown;
  for (const c of list) {
    try {
      return { dir: c.dir, ck: await loadCheckpoint(c.dir), run: path };
    } catch (e) {
      first ??= e;
    }
  }
  if (first) throw first;
  if (holdsRun(path) || startedRun(path)) {
    // a run killed before its first save finished, perhaps while it wrote its run.json
    const cmd = restartCommand(path);
    throw new LayerwiseError(
      `run folder ${path} holds no complete checkpoint yet (the run stopped before its first save finished); ${cmd ? `start it again with: ${cmd}` : NO_COMMAND}`,
    );
  }
  throw new LayerwiseError(
    `${path} holds no layerwise checkpoint; give the --out folder of an earlier 'layerwise train' run (or its checkpoint folder)`,
  );
}

/**
 * After resuming run folder `out` from its checkpoint folder `keep` (found by
 * {@link findCheckpoint}): points the pointer at `keep` when it is a `step-<N>` folder, then
 * removes every other checkpoint and every leftover of an interrupted save. An earlier
 * version's `checkpoint/` folder is kept until the first new save. Returns the paths removed.
 */
export async function cleanCheckpoints(
  out: string,
  keep: string,
): Promise<string[]> {
  const rel = relative(resolve(out), resolve(keep));
  const name = rel.startsWith(`${CHECKPOINTS}/`)
    ? rel.slice(CHECKPOINTS.length + 1)
    : undefined;
  const step = name === undefined ? undefined : stepOfName(name);
  if (name !== undefined && step !== undefined) {
    if (readPointer(out)?.dir !== name) await switchPointer(out, name, step);
    return removeOthers(out, keep);
  }
  // an earlier version's checkpoint: remove only what is not a checkpoint
  const removed: string[] = [];
  for (const n of readdirSync(out))
    if (n.startsWith(`${OLD_CHECKPOINT}.tmp-`)) {
      await rm(join(out, n), { recursive: true, force: true });
      removed.push(join(out, n));
    }
  return removed;
}

/** The newest checkpoint folder the pointer of run folder `out` names (else an earlier version's `checkpoint/`). */
export function checkpointDir(out: string): string {
  const ptr = readPointer(out);
  return ptr ? join(out, CHECKPOINTS, ptr.dir) : join(out, OLD_CHECKPOINT);
}

function bad(dir: string, what: string): never {
  throw new LayerwiseError(
    `checkpoint ${dir} is corrupt or not a layerwise checkpoint: ${what}; point --resume/--checkpoint at a folder written by 'layerwise train' (it holds meta.json, params.bin, optimizer.bin)`,
  );
}

/** A well-formed checkpoint whose parameters are not the model's (throws LayerwiseError). */
function misfit(dir: string, what: string): never {
  throw new LayerwiseError(
    `checkpoint ${dir} does not fit its model: ${what}. It was written for a different model ` +
      "(an earlier layerwise version of the preset: cnn-mnist's convolution and pooling became separate blocks; or a model module changed since): start a new run, or use the version that wrote it",
  );
}

async function readBin(
  dir: string,
  name: string,
  expected: FileInfo,
): Promise<Float32Array> {
  let buf: Buffer;
  try {
    buf = await readFile(join(dir, name));
  } catch {
    bad(dir, `${name} is missing`);
  }
  if (buf.byteLength !== expected?.bytes)
    bad(
      dir,
      `${name} has ${buf.byteLength} bytes, meta.json says ${expected?.bytes}`,
    );
  if (createHash('sha256').update(buf).digest('hex') !== expected.sha256)
    bad(dir, `${name} does not match its SHA-256 in meta.json`);
  const copy = new Uint8Array(buf.byteLength);
  copy.set(buf);
  return new Float32Array(copy.buffer);
}

function slice(
  dir: string,
  all: Float32Array,
  e: ArrayEntry,
  file: string,
): Float32Array {
  if (
    !Number.isInteger(e.offset) ||
    !Number.isInteger(e.length) ||
    e.offset < 0 ||
    e.offset + e.length > all.length
  ) {
    bad(dir, `${file} entry ${e.key} lies outside the file`);
  }
  return all.slice(e.offset, e.offset + e.length);
}

/** A checkpoint's meta.json as parsed, before it is checked. */
interface MetaJson {
  format?: string;
  version?: number;
  step?: number;
  config?: Record<string, unknown>;
  model?: ModelConfig;
  vocab?: unknown;
  data?: unknown;
  stats?: CheckpointMeta['stats'];
  params?: ArrayEntry[];
  optimizer?: { step: number; slots: ArrayEntry[] };
  files?: Record<string, FileInfo>;
}

/** meta.json of this format and version, with every field a checkpoint needs. */
type CheckedMeta = MetaJson &
  Required<
    Pick<
      MetaJson,
      'step' | 'config' | 'model' | 'params' | 'optimizer' | 'files'
    >
  >;

/** Checks that checkpoint folder `dir` exists and is a folder (throws {@link LayerwiseError}). */
async function checkFolder(dir: string): Promise<void> {
  try {
    if (!(await stat(dir)).isDirectory()) bad(dir, 'it is not a folder');
  } catch (e) {
    if (e instanceof LayerwiseError) throw e;
    throw new LayerwiseError(
      `checkpoint folder ${dir} does not exist; give the --out folder of an earlier 'layerwise train' run`,
    );
  }
}

/**
 * The meta.json of checkpoint folder `dir`. Throws {@link LayerwiseError} when it is missing,
 * not JSON, of another format or version, or lacks step, config, model, params, optimizer or
 * files.
 */
async function readMeta(dir: string): Promise<CheckedMeta> {
  let text: string;
  try {
    text = await readFile(join(dir, 'meta.json'), 'utf8');
  } catch {
    bad(dir, 'meta.json is missing');
  }
  let meta: MetaJson;
  try {
    meta = JSON.parse(text);
  } catch {
    bad(dir, 'meta.json is not valid JSON');
  }
  if (meta.format !== CHECKPOINT_FORMAT)
    bad(dir, `meta.json format is ${JSON.stringify(meta.format)}`);
  if (meta.version !== CHECKPOINT_VERSION)
    bad(
      dir,
      `version ${meta.version} (this layerwise reads version ${CHECKPOINT_VERSION})`,
    );
  if (
    !meta.model ||
    !Array.isArray(meta.params) ||
    !meta.optimizer ||
    !meta.files ||
    !Number.isInteger(meta.step) ||
    !meta.config
  ) {
    bad(dir, 'meta.json lacks step, config, model, params, optimizer or files');
  }
  return meta as CheckedMeta;
}

/**
 * The parameters of a checkpoint (`entries`: meta.json's index into params.bin's values
 * `pAll`), by key: every parameter of the model's blocks, then the auxiliary heads' (local
 * parallelism). Throws {@link LayerwiseError} for a parameter of the model that is missing or of
 * another shape, one of no block, or an entry outside the file.
 */
function readParams(
  dir: string,
  model: Model,
  entries: ArrayEntry[],
  pAll: Float32Array,
): HostParams {
  const byKey = new Map(entries.map((e) => [e.key, e]));
  const params: HostParams = new Map();
  model.blocks.forEach((b, bi) =>
    b.params.forEach((spec) => {
      const key = paramKey(bi, spec.name);
      const e = byKey.get(key);
      if (!e) misfit(dir, `parameter ${key} (${b.name}) is missing`);
      if (
        e.shape.join(',') !== spec.shape.join(',') ||
        e.length !== sizeOf(spec.shape)
      ) {
        misfit(
          dir,
          `parameter ${key} (${b.name}) has shape [${e.shape}], the model needs [${spec.shape}]`,
        );
      }
      params.set(key, slice(dir, pAll, e, 'params.bin'));
    }),
  );
  for (const [key, e] of byKey) {
    if (params.has(key)) continue;
    if (!/^aux\d+\./.test(key))
      bad(dir, `parameter ${key} belongs to no block of the model`);
    params.set(key, slice(dir, pAll, e, 'params.bin')); // an auxiliary head (local parallelism)
  }
  return params;
}

/**
 * The optimizer slots of a checkpoint (`entries`: meta.json's index into optimizer.bin's values
 * `oAll`), by parameter key and slot name. Throws {@link LayerwiseError} for a slot of an
 * unknown parameter, one of another length than its parameter, or an entry outside the file.
 */
function readSlots(
  dir: string,
  entries: ArrayEntry[],
  params: HostParams,
  oAll: Float32Array,
): OptimizerState['slots'] {
  const slots: OptimizerState['slots'] = {};
  for (const e of entries) {
    const p = params.get(e.key);
    if (!p || !e.slot)
      bad(dir, `optimizer state for unknown parameter ${e.key}`);
    if (e.length !== p.length)
      bad(
        dir,
        `optimizer slot ${e.key}.${e.slot} has ${e.length} values, the parameter ${p.length}`,
      );
    (slots[e.key] ??= {})[e.slot] = slice(dir, oAll, e, 'optimizer.bin');
  }
  return slots;
}

/**
 * Loads and validates a checkpoint folder. Throws {@link LayerwiseError} when the folder or a
 * file is missing, meta.json is malformed or of another format/version, a file's size or hash
 * differs, or the parameters do not match the model the checkpoint's config describes.
 */
export async function loadCheckpoint(dir: string): Promise<Checkpoint> {
  await checkFolder(dir);
  const meta = await readMeta(dir);
  const model = await loadModel(meta.model);
  const pAll = await readBin(dir, 'params.bin', meta.files['params.bin']);
  const oAll = await readBin(dir, 'optimizer.bin', meta.files['optimizer.bin']);
  const params = readParams(dir, model, meta.params, pAll);
  const slots = readSlots(dir, meta.optimizer.slots, params, oAll);
  return {
    step: meta.step,
    config: meta.config,
    model: meta.model,
    vocab: meta.vocab,
    data: meta.data,
    stats: meta.stats ?? { wallS: 0 },
    params,
    optimizer: { step: meta.optimizer.step, slots },
  };
}
