/**
 * Export a trained run for inference outside layerwise, in TF.js's own formats.
 *
 * - A model module built with tf.layers: `model.json` (the model's topology and a weights
 *   manifest, format 'layers-model') and `weights.bin`, what `tf.loadLayersModel` reads, from a
 *   web server (`tf.loadLayersModel('https://.../model.json')`) or in Node from memory
 *   (`tf.io.fromMemory({modelTopology, weightSpecs, weightData})`; see the README). Custom
 *   layers must be registered (import the module) before loading.
 * - A preset or a block list: `weights.bin` and `weights.json`, a tf.io weights manifest
 *   (`tf.io.decodeWeights(buffer, manifest[0].weights)` gives the named tensors) with the
 *   layerwise model configuration beside it, so `loadModel(config)` rebuilds the blocks that
 *   run them.
 * Both are written into a temporary folder and renamed into place: nothing half-written.
 */
import { readdir, readFile, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as tf from '@tensorflow/tfjs-core';
import * as tfl from '@tensorflow/tfjs-layers';
import { paramKey } from '../model/block.js';
import { loadModel, type Model } from '../model/model.js';
import { loadModelModule } from '../model/module.js';
import { check } from '../util/errors.js';
import { replaceDirAtomic } from '../util/fsx.js';
import { findCheckpoint } from './checkpoint-io.js';

/** What {@link exportRun} wrote. */
export interface ExportResult {
  /** 'layers-model' (loadable by tf.loadLayersModel) or 'weights' (a tf.io weights manifest). */
  format: 'layers-model' | 'weights';
  /** Files written, relative to the output folder. */
  files: string[];
  /** Parameters (elements) exported. */
  params: number;
}

/** The checkpoint's parameters as named tensors in the model's block order. */
function namedParams(
  model: Model,
  params: Map<string, Float32Array>,
): Array<{ name: string; tensor: tf.Tensor }> {
  return model.blocks.flatMap((b, bi) =>
    b.params.map((s) => {
      const v = params.get(paramKey(bi, s.name));
      check(
        v !== undefined,
        () =>
          `the checkpoint has no value for parameter ${paramKey(bi, s.name)}; it does not belong to this model`,
      );
      return { name: `${b.name}/${s.name}`, tensor: tf.tensor(v!, s.shape) };
    }),
  );
}

/** `out` may be new or an earlier export (replaced); anything else is refused, untouched. */
async function checkOut(out: string): Promise<void> {
  const st = await stat(out).catch(() => undefined);
  if (!st) return;
  check(
    st.isDirectory(),
    () =>
      `--out ${out} is a file; give a new folder (or an earlier export to replace)`,
  );
  const entries = await readdir(out);
  const exported = new Set(['model.json', 'weights.json', 'weights.bin']);
  check(
    entries.every((e) => exported.has(e)),
    () =>
      `--out ${out} is a folder with other files (${entries
        .filter((e) => !exported.has(e))
        .slice(0, 3)
        .join(
          ', ',
        )}); give a new folder (an earlier export is replaced, nothing else is)`,
  );
}

/**
 * Writes the trained model of run folder `run` (or its checkpoint folder) to `out`.
 * @throws LayerwiseError when `out` is a file or a folder that is not an earlier export, the
 *   checkpoint is missing or corrupt, or its model module no longer loads or no longer matches
 *   the checkpoint.
 */
export async function exportRun(
  run: string,
  out: string,
): Promise<ExportResult> {
  await checkOut(out);
  const { ck } = await findCheckpoint(run);
  const model = await loadModel(ck.model);
  const tensors = tf.tidy(() => namedParams(model, ck.params));
  try {
    const topology =
      ck.model.arch === 'module'
        ? (await loadModelModule(ck.model.path)).topology
        : undefined;
    if (topology !== undefined) {
      const layers = await tfl.models.modelFromJSON({
        modelTopology: topology as tf.io.ModelJSON['modelTopology'],
      });
      const weights = layers.trainableWeights;
      check(
        weights.length === tensors.length &&
          weights.every((w, i) =>
            tf.util.arraysEqual(w.shape as number[], tensors[i]!.tensor.shape),
          ),
        () =>
          `model module ${ck.model.arch === 'module' ? ck.model.path : ''} builds a model whose weights no longer match the checkpoint's; export with the module as it was when training`,
      );
      layers.setWeights(tensors.map((t) => t.tensor));
      let artifacts: tf.io.ModelArtifacts | undefined;
      await layers.save(
        tf.io.withSaveHandler(async (a) => {
          artifacts = a;
          return {
            modelArtifactsInfo: {
              dateSaved: new Date(),
              modelTopologyType: 'JSON',
            },
          };
        }),
      );
      const a = artifacts!;
      const json = {
        modelTopology: a.modelTopology,
        format: a.format ?? 'layers-model',
        generatedBy: a.generatedBy,
        convertedBy: 'layerwise',
        weightsManifest: [{ paths: ['weights.bin'], weights: a.weightSpecs }],
      };
      await replaceDirAtomic(out, async (dir) => {
        await writeFile(join(dir, 'model.json'), JSON.stringify(json));
        await writeFile(
          join(dir, 'weights.bin'),
          new Uint8Array(a.weightData as ArrayBuffer),
        );
      });
      layers.dispose();
      return {
        format: 'layers-model',
        files: ['model.json', 'weights.bin'],
        params: tensors.reduce((s, t) => s + t.tensor.size, 0),
      };
    }
    const { data, specs } = await tf.io.encodeWeights(tensors);
    await replaceDirAtomic(out, async (dir) => {
      await writeFile(
        join(dir, 'weights.json'),
        JSON.stringify(
          {
            format: 'layerwise-weights',
            model: ck.model,
            weightsManifest: [{ paths: ['weights.bin'], weights: specs }],
          },
          null,
          1,
        ),
      );
      await writeFile(join(dir, 'weights.bin'), new Uint8Array(data));
    });
    return {
      format: 'weights',
      files: ['weights.json', 'weights.bin'],
      params: tensors.reduce((s, t) => s + t.tensor.size, 0),
    };
  } finally {
    tensors.forEach((t) => t.tensor.dispose());
  }
}

/**
 * Loads an exported layers model from a folder in Node with plain TF.js: reads model.json and
 * weights.bin and hands them to `tf.loadLayersModel` through `tf.io.fromMemory`.
 */
export async function loadExportedLayersModel(
  dir: string,
): Promise<tfl.LayersModel> {
  const json = JSON.parse(await readFile(join(dir, 'model.json'), 'utf8')) as {
    modelTopology: object;
    weightsManifest: Array<{ weights: tf.io.WeightsManifestEntry[] }>;
  };
  const bin = await readFile(join(dir, 'weights.bin'));
  return tfl.loadLayersModel(
    tf.io.fromMemory({
      modelTopology: json.modelTopology,
      weightSpecs: json.weightsManifest[0]!.weights,
      weightData: bin.buffer.slice(
        bin.byteOffset,
        bin.byteOffset + bin.byteLength,
      ),
    }),
  );
}
