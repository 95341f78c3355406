/**
 * The one checkpoint format: a folder with
 *   meta.json      format/version, step, training and model config, vocabulary, data position,
 *                  the index of every array, and the size and SHA-256 of each binary file;
 *   params.bin     every parameter, fp32 little-endian, in index order;
 *   optimizer.bin  every optimizer slot (momentum, Adam m and v), fp32, in index order.
 * Parameters and optimizer state are keyed by parameter key (`<block>.<name>`), so a checkpoint
 * is independent of the strategy and partition that wrote it. Written atomically
 * (temp folder + rename); every read is validated and a bad checkpoint raises a
 * {@link LayerwiseError} that names the file and the problem.
 */
import { createHash } from 'node:crypto';
import { existsSync, statSync } from 'node:fs';
import { readFile, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { paramKey, sizeOf } from '../model/block.js';
import type { HostParams } from '../model/init.js';
import { loadModel, type ModelConfig } from '../model/model.js';
import type { OptimizerState } from '../optim/optimizer.js';
import { LayerwiseError } from '../util/errors.js';
import { replaceDirAtomic } from '../util/fsx.js';

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
  /** Run statistics carried across resumes: first loss of the run, wall seconds so far. */
  stats: { initialLoss?: number; wallS: number };
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

/** Writes a checkpoint folder at `dir` atomically, replacing any previous one. */
export async function saveCheckpoint(
  dir: string,
  ck: Checkpoint,
): Promise<void> {
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
  await replaceDirAtomic(dir, async (tmp) => {
    await writeFile(join(tmp, 'params.bin'), p.bin);
    await writeFile(join(tmp, 'optimizer.bin'), o.bin);
    await writeFile(join(tmp, 'meta.json'), JSON.stringify(meta, null, 1));
  });
}

/** Where a run folder keeps its checkpoint. */
export function checkpointDir(out: string): string {
  return join(out, 'checkpoint');
}

/** Accepts a run folder or its checkpoint folder; returns the checkpoint folder. */
export function resolveCheckpointDir(dir: string): string {
  let isFile = false;
  try {
    isFile = !statSync(dir).isDirectory();
  } catch {
    // missing: loadCheckpoint says so
  }
  if (isFile)
    throw new LayerwiseError(
      `${dir} is a file, not a run folder; give the --out folder of an earlier 'layerwise train' run (or its checkpoint folder)`,
    );
  return existsSync(join(dir, 'meta.json')) ? dir : checkpointDir(dir);
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

/**
 * Loads and validates a checkpoint folder. Throws {@link LayerwiseError} when the folder or a
 * file is missing, meta.json is malformed or of another format/version, a file's size or hash
 * differs, or the parameters do not match the model the checkpoint's config describes.
 */
export async function loadCheckpoint(dir: string): Promise<Checkpoint> {
  try {
    if (!(await stat(dir)).isDirectory()) bad(dir, 'it is not a folder');
  } catch (e) {
    if (e instanceof LayerwiseError) throw e;
    throw new LayerwiseError(
      `checkpoint folder ${dir} does not exist; give the --out folder of an earlier 'layerwise train' run`,
    );
  }
  let text: string;
  try {
    text = await readFile(join(dir, 'meta.json'), 'utf8');
  } catch {
    bad(dir, 'meta.json is missing');
  }
  let meta: {
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
  };
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
  const model = await loadModel(meta.model);
  const pAll = await readBin(dir, 'params.bin', meta.files['params.bin']);
  const oAll = await readBin(dir, 'optimizer.bin', meta.files['optimizer.bin']);
  const byKey = new Map(meta.params.map((e) => [e.key, e]));
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
  const slots: OptimizerState['slots'] = {};
  for (const e of meta.optimizer.slots) {
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
  return {
    step: meta.step!,
    config: meta.config!,
    model: meta.model!,
    vocab: meta.vocab,
    data: meta.data,
    stats: meta.stats ?? { wallS: 0 },
    params,
    optimizer: { step: meta.optimizer.step, slots },
  };
}
