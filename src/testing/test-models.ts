/**
 * Test helper: the model modules of testing/models/ (users' own models, as a user would write
 * them) loaded as layerwise models (tests only).
 */
import { fileURLToPath } from 'node:url';
import { loadModel, type Model, type ModuleConfig } from '../model/model.js';
import { loadModelModule } from '../model/module.js';

/** The absolute path of the compiled test model module `name` (testing/models/<name>.js). */
export const testModelPath = (name: string): string =>
  fileURLToPath(new URL(`./models/${name}.js`, import.meta.url));

/**
 * Loads test model module `name` in this thread as a layerwise model, with its declared or
 * implied loss (softmax cross-entropy when it implies none).
 */
export async function loadTestModel(name: string): Promise<Model> {
  const path = testModelPath(name);
  const m = await loadModelModule(path);
  const cfg: ModuleConfig = {
    arch: 'module',
    path,
    loss: m.loss ?? 'softmax-cross-entropy',
    inputShape: m.inputShape,
    inputDtype: m.inputDtype,
  };
  return loadModel(cfg);
}
