/**
 * Single-device training, the reference every other strategy is checked against: the whole
 * model on one device, plain backprop on the whole mini-batch (one micro-batch, activations
 * kept). It is the backprop pipeline (gpipe.ts) with one stage.
 */

import { lossScalingOf, optimizerConfigOf } from '../config/config.js';
import { costsAt, optimizerSlots } from '../cost/costs.js';
import { predictPeakBytes } from '../cost/memory.js';
import { plannedAs } from '../cost/strategy-plan.js';
import { parseDevices } from '../runtime/devices.js';
import { check } from '../util/errors.js';
import { backpropPipeline } from './gpipe.js';
import { PipelineStrategy, runOptionsOf } from './pipeline.js';
import { type StrategySpec, threadsPerDevice } from './spec.js';

export const single: StrategySpec = {
  name: 'single',
  help: 'the whole model on one device, plain backprop (the reference)',
  exact: true,
  oneDevice: true,
  layerDrop: true,
  isDefault: true,
  validate(cfg) {
    check(
      cfg.stages === 1,
      `--strategy single runs on one device; drop --stages ${cfg.stages} or use --strategy gpipe`,
    );
  },
  create: (cfg, model, params, ranges) =>
    PipelineStrategy.create(
      {
        name: 'single',
        ...runOptionsOf(cfg, model, ranges),
        microBatches: 1,
        kind: backpropPipeline(1, 1, 'never', 'gpipe'),
        threads: threadsPerDevice(cfg, cfg.replicas),
        devices: parseDevices(cfg.devices, 1, cfg.replicas),
        replicas: cfg.replicas,
        lossScaling: lossScalingOf(cfg),
        oomAdvice: single.outOfMemoryAdvice(cfg),
      },
      params,
    ),
  memory: {
    microBatch: (cfg) => cfg.batchSize / cfg.replicas,
    predictPeakBytes: (profile, cfg, ranges) =>
      predictPeakBytes(costsAt(profile, cfg.batchSize / cfg.replicas), ranges, {
        m: 1,
        remat: 'never',
        schedule: 'gpipe',
        slots: optimizerSlots(optimizerConfigOf(cfg)),
      }),
  },
  /** The whole model, M = 1, activations kept. */
  plan: (profile, req) =>
    plannedAs(
      'single',
      profile,
      req,
      [{ from: 0, to: profile.blocks.length }],
      { m: 1, remat: 'never', schedule: 'gpipe', slots: req.slots },
      'whole model',
    ),
  flags: () => '--strategy single',
  outOfMemoryAdvice: () =>
    'try --strategy l2l, or --strategy gpipe with more --stages',
};
