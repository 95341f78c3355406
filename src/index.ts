/**
 * layerwise: train deep networks split by layers, on TensorFlow.js.
 *
 * The library API, layer by layer (see docs/ARCHITECTURE.md):
 * - backend: {@link initBackend} picks and prepares a device's TF.js backend;
 * - model: blocks, presets, {@link buildModel}, {@link initParams};
 * - schedule: pipeline schedules as plain data and their simulation;
 * - partition: balancing blocks over stages, and a run's partition ({@link partitionBlocks});
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
export { type BackendName, initBackend } from './backend/index.js';
export { DeviceOutOfMemoryError } from './backend/out-of-memory.js';
export { resolveConfig, type TrainConfig } from './config/config.js';
export {
  type BlockCost,
  costsAt,
  type ModelProfile,
  optimizerSlots,
} from './cost/costs.js';
export {
  predictLocalPeakBytes,
  predictPeakBytes,
  predictRelayPeakBytes,
} from './cost/memory.js';
export { type ProfileOptions, profileModel } from './cost/profile.js';
export {
  predictLocalStepTime,
  predictRelayStepTime,
  predictStepTime,
} from './cost/time.js';
export * from './data/index.js';
export { splitMicroBatches } from './data/microbatch.js';
export type { Block, BlockParams, Init, ParamSpec } from './model/block.js';
export { paramCount, paramKey } from './model/block.js';
export { type HostParams, initParams } from './model/init.js';
export {
  buildModel,
  type Model,
  type ModelConfig,
  modelParamCount,
} from './model/model.js';
export { getPreset, PRESETS } from './model/presets.js';
export { type LrSchedule, learningRate } from './optim/lr.js';
export {
  clipScale,
  DeviceOptimizer,
  defaultOptimizerConfig,
  type OptimizerConfig,
} from './optim/optimizer.js';
export { hostUpdate } from './param-server/host-optimizer.js';
export { ParameterServer, type ServerSpan } from './param-server/server.js';
export { ParamStore, type StoreLayout } from './param-server/store.js';
export {
  balanceByCost,
  type StageRange,
  stageRanges,
  validateBalance,
} from './partition/balance.js';
export {
  BALANCE_KINDS,
  type BalanceKind,
  blockFlops,
  type PartitionRequest,
  partitionBlocks,
  partitionProfiled,
} from './partition/stages.js';
export {
  execute,
  type Handlers,
  type LayerGrads,
  ScheduleError,
  type StageLinks,
  type StageProgram,
  type StepIO,
  type TraceSpan,
  WAITING_LABELS,
  waitingMs,
} from './pipeline/executor.js';
export { type LocalRole, LocalStage } from './pipeline/local-stage.js';
export {
  type RelayOptions,
  RelayStage,
  type StashPlace,
} from './pipeline/relay-stage.js';
export { Stage } from './pipeline/stage.js';
export {
  type CreateStage,
  loadStageKind,
  type StageContext,
  type StageKindRef,
} from './pipeline/stage-kind.js';
export { checkDeviceBudget } from './plan/budget.js';
export {
  type Plan,
  type PlanRequest,
  plan,
  type StrategyPlan,
} from './plan/plan.js';
export { StageError } from './runtime/device.js';
export {
  type Action,
  clockCycles,
  evalSchedule,
  formatAction,
  formatSchedule,
  formatScheduleError,
  gpipeSchedule,
  idealBubble,
  localSchedule,
  makeSchedule,
  oneFOneBSchedule,
  type RematMode,
  relayEvalSchedule,
  relaySchedule,
  type Schedule,
  type ScheduleKind,
} from './schedule/schedule.js';
export { type SimResult, simulate } from './schedule/simulate.js';
export { backpropPipeline, gpipe } from './strategies/gpipe.js';
export {
  createStrategy,
  planStages,
  resolveStages,
  STRATEGY_NAMES,
  STRATEGY_SPECS,
  specOf,
} from './strategies/index.js';
export { type L2LOptions, L2LStrategy, l2l } from './strategies/l2l.js';
export { local, localPipeline } from './strategies/local.js';
export {
  type PipelineKind,
  type PipelineOptions,
  PipelineStrategy,
} from './strategies/pipeline.js';
export { single } from './strategies/single.js';
export type { StrategySpec } from './strategies/spec.js';
export type { StepReport, Strategy } from './strategies/strategy.js';
export {
  type Checkpoint,
  loadCheckpoint,
  saveCheckpoint,
} from './train/checkpoint-io.js';
export {
  type LoopEnd,
  type LoopIO,
  type LoopSetup,
  type RunSoFar,
  TrainingLoop,
} from './train/loop.js';
export type { StepMetrics, Summary } from './train/metrics.js';
export { sampleText } from './train/sample.js';
export { prepare, type TrainHooks, train } from './train/trainer.js';
export { LayerwiseError } from './util/errors.js';
export { parseSize } from './util/size.js';
