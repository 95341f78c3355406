/**
 * layerwise: train deep networks split by layers, on TensorFlow.js.
 *
 * The library API, layer by layer (see docs/ARCHITECTURE.md):
 * - backend: {@link initBackend} picks and prepares a device's TF.js backend;
 * - model: blocks, presets, {@link buildModel}, {@link initParams};
 * - schedule: pipeline schedules as plain data and their simulation;
 * - partition: balancing blocks over stages;
 * - param-server: L2L's eager parameter server (parameters and optimizer state in shared host memory,
 *   host optimizer in worker threads);
 * - pipeline: the one executor, the stage kinds (backprop, local, relay), re-materialization;
 * - cost: profiling blocks, memory and time predictions;
 * - runtime: worker-thread devices, channels, tensor serialization;
 * - strategies: single, gpipe, local and l2l, each a {@link StrategySpec}, behind one {@link Strategy} interface;
 * - plan: which strategy fits a device-memory budget;
 * - train: the trainer loop, checkpoints, metrics, sampling;
 * - data: data sets, the resumable batcher, micro-batches.
 */
export { initBackend, type BackendName } from './backend/index.js';
export { LayerwiseError } from './util/errors.js';
export * from './data/index.js';
export type { Block, ParamSpec, Init, BlockParams } from './model/block.js';
export { paramCount, paramKey } from './model/block.js';
export { initParams, type HostParams } from './model/init.js';
export { buildModel, modelParamCount, type Model, type ModelConfig } from './model/model.js';
export { PRESETS, getPreset } from './model/presets.js';
export {
  gpipeSchedule, oneFOneBSchedule, evalSchedule, makeSchedule, clockCycles, formatSchedule, formatAction, idealBubble,
  localSchedule, relaySchedule, relayEvalSchedule,
  formatScheduleError, type Action, type Schedule, type RematMode, type ScheduleKind,
} from './schedule/schedule.js';
export { simulate, type SimResult } from './schedule/simulate.js';
export { balanceByCost, validateBalance, stageRanges, type StageRange } from './partition/balance.js';
export { profileModel, type ProfileOptions } from './cost/profile.js';
export { costsAt, optimizerSlots, type ModelProfile, type BlockCost } from './cost/costs.js';
export { predictPeakBytes, predictLocalPeakBytes, predictRelayPeakBytes } from './cost/memory.js';
export { predictStepTime, predictLocalStepTime, predictRelayStepTime } from './cost/time.js';
export { checkDeviceBudget } from './plan/budget.js';
export { DeviceOutOfMemoryError } from './backend/out-of-memory.js';
export { plan, type Plan, type PlanRequest, type StrategyPlan } from './plan/plan.js';
export { parseSize } from './util/size.js';
export { splitMicroBatches } from './data/microbatch.js';
export { Stage } from './pipeline/stage.js';
export { LocalStage, type LocalRole } from './pipeline/local-stage.js';
export { RelayStage, type StashPlace, type RelayOptions } from './pipeline/relay-stage.js';
export { loadStageKind, type StageKindRef, type StageContext, type CreateStage } from './pipeline/stage-kind.js';
export { ParameterServer, type ServerSpan } from './param-server/server.js';
export { ParamStore, type StoreLayout } from './param-server/store.js';
export { hostUpdate } from './param-server/host-optimizer.js';
export {
  execute, ScheduleError, WAITING_LABELS, waitingMs,
  type StageLinks, type StageProgram, type Handlers, type StepIO, type TraceSpan, type LayerGrads,
} from './pipeline/executor.js';
export { DeviceOptimizer, clipScale, defaultOptimizerConfig, type OptimizerConfig } from './optim/optimizer.js';
export { learningRate, type LrSchedule } from './optim/lr.js';
export { PipelineStrategy, type PipelineKind, type PipelineOptions } from './strategies/pipeline.js';
export { L2LStrategy, type L2LOptions, l2l } from './strategies/l2l.js';
export { single } from './strategies/single.js';
export { gpipe, backpropPipeline } from './strategies/gpipe.js';
export { local, localPipeline } from './strategies/local.js';
export { createStrategy, planStages, resolveStages, STRATEGY_SPECS, STRATEGY_NAMES, specOf } from './strategies/index.js';
export type { StrategySpec } from './strategies/spec.js';
export type { Strategy, StepReport } from './strategies/strategy.js';
export { StageError } from './runtime/device.js';
export { train, prepare, type TrainHooks } from './train/trainer.js';
export { resolveConfig, type TrainConfig } from './config/config.js';
export { saveCheckpoint, loadCheckpoint, type Checkpoint } from './train/checkpoint-io.js';
export { sampleText } from './train/sample.js';
