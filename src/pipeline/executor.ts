/**
 * The one executor: interprets a stage's action list (schedule/schedule.ts) against a
 * {@link StageProgram} and the stage's {@link StageLinks}, as PyTorch pipelining's runtime
 * does (torch/distributed/pipelining/schedules.py, `_comp_type_to_function_map`).
 *
 * - The core owns communication and tracing: receives and sends of activations and gradients
 *   (into and out of the step's mailboxes), the gradient-norm all-reduce, polling and draining
 *   overlap gradients, and one {@link TraceSpan} per action.
 * - Compute actions are dispatched through the handler table the stage kind provides
 *   ({@link StageProgram.handlers}): a backprop stage maps forward / backward / optimizer_step,
 *   a local-parallelism stage local_update / overlap_backward / local_step, the L2L relay
 *   load_layer / layer_forward / layer_backward / push_grads / ... A stage kind plugs in without
 *   a branch here.
 *
 * When an action fails, the error carries the stage's schedule with that action marked
 * (`<-- ERROR HERE`, as PyTorch pipelining prints it): see {@link ScheduleError}.
 */

import {
  type GpuQueue,
  type GpuSubmit,
  gpuQueue,
} from '../backend/gpu-queue.js';
import type { tf } from '../backend/tfjs.js';
import type { HostParams } from '../model/init.js';
import type { StepNoise } from '../model/noise.js';
import type { OptimizerState } from '../optim/optimizer.js';
import {
  type ActionOf,
  CORE_OPS,
  type CoreOp,
  declarationOf,
  OPS,
} from '../schedule/ops.js';
import {
  type Action,
  type ComputeOp,
  formatScheduleError,
} from '../schedule/schedule.js';

/** A layer's accumulated gradient on its way to the parameter server (L2L; host copies, by parameter key). */
export interface LayerGrads {
  layer: number;
  grads: Record<string, Float32Array>;
  /** Sum of squares of every element of `grads` (for global-norm clipping; 0 when clipping is off). */
  sumSquares: number;
}

/**
 * How a device's stages talk to the rest of the pipeline (implemented over channels by
 * runtime/stage-host.ts). `stage` is the (virtual) stage of the action: a device running
 * several stages has one FIFO per stage and direction.
 */
export interface StageLinks {
  /** Next activation for `stage` from stage - 1 (FIFO). */
  recvActivation(stage: number): Promise<{ mb: number; t: tf.Tensor }>;
  /** Sends `stage`'s output activation to stage + 1; the tensor is disposed by the link. Resolves once it is read off the device. */
  sendActivation(stage: number, mb: number, t: tf.Tensor): void | Promise<void>;
  /** Next output gradient for `stage` from stage + 1 (FIFO). */
  recvGradient(stage: number): Promise<{ mb: number; t: tf.Tensor }>;
  /** An output gradient for `stage` from stage + 1 if one has arrived, else null. */
  pollGradient(stage: number): { mb: number; t: tf.Tensor } | null;
  /** Sends `stage`'s input gradient to stage - 1; the tensor is disposed by the link. Resolves once it is read off the device. */
  sendGradient(stage: number, mb: number, t: tf.Tensor): void | Promise<void>;
  /** All-reduce of squared gradient norms: returns the global clipping scale. */
  reduceGradNorm(sumSquares: number): Promise<number>;
  /**
   * Data parallelism: sums `values` element-wise across the replicas of this device's stages
   * (a ring all-reduce over the replica links), in place; every replica ends with the same sums.
   */
  allReduce?(values: Float32Array[]): Promise<void>;
  /** L2L: hands a layer's accumulated gradient to the parameter server (buffers are transferred). */
  pushGrads?(g: LayerGrads): void;
}

/** What one step of the executor is given. */
export interface StepInputs {
  /** First stage: the inputs of each micro-batch. */
  inputs?: tf.Tensor[];
  /** The labels of each micro-batch: on the last stage, and on every stage for local parallelism. */
  labels?: tf.Tensor[];
  /** Number of micro-batches M. */
  m: number;
  /**
   * Data-parallel replicas R running this step, each on its own part of the mini-batch
   * (default 1): the mini-batch loss averages M x R micro-batch losses.
   */
  replicas?: number;
  /**
   * Loss scaling (f16, Micikevicius et al., 2018): the loss is multiplied by this before
   * backward, so small gradients survive f16; default 1.
   */
  lossScale?: number;
  /** Learning rate of this step. */
  lr: number;
  /**
   * Diagnosis of a numeric fault: the stage checks each block's output, the loss and each
   * block's gradients for non-finite values (recording {@link NumericFault}s) and updates nothing.
   */
  diagnose?: boolean;
  /**
   * Blocks (model indices) this training step skips (LayerDrop, model/layer-drop.ts): not
   * computed, no gradient, not stepped. Absent: none (evaluation always runs every block).
   */
  dropped?: readonly number[];
  /**
   * Where this step's micro-batches sit, for the noise of Dropout and its kin (model/noise.ts):
   * the run's seed, the step and this replica's first example. Absent: no noise (evaluation).
   */
  noise?: StepNoise;
}

/** A non-finite value a stage found while diagnosing a step (see {@link StepInputs.diagnose}). */
export interface NumericFault {
  /** 'input': the stage's input; 'activation': a block's output; 'loss'; 'gradient': a block's parameter gradients. */
  what: 'input' | 'activation' | 'loss' | 'gradient';
  stage: number;
  /** The model's block index (and name) where it appeared. */
  block: number;
  blockName: string;
  mb: number;
  /** NaN or Infinity (the first non-finite value seen). */
  value: string;
}

/**
 * One executed action: op, micro-batch and its start/end in ms since the step began. An action
 * may be split in two phases (see {@link StepIO.phase}): a backward with re-materialization
 * gives `recompute` then `backward`; an L2L load that waited gives `wait_params` then `upload`.
 */
export interface TraceSpan {
  /** The op, or the label of one of its phases. */
  label: string;
  op: Action['op'];
  /** The action's (virtual) stage. */
  stage: number;
  mb: number;
  /** L2L: the layer the action works on. */
  layer?: number;
  start: number;
  end: number;
  /**
   * The GPU's execution of the action (webgpu, actions whose handler called
   * {@link StepIO.gpuWork}), not the host's: from the action's first submit, or the end of the
   * GPU's previous span if later, to when the GPU reported the work done.
   */
  gpu?: true;
  /** GPU spans: host milliseconds spent inside `queue.submit` during the action (a software GPU runs the work there). */
  submitMs?: number;
}

/**
 * Labels of the spans in which a stage waits for another stage or for the parameter server:
 * the ops declared as waiting (schedule/ops.ts: receives, the norm all-reduce, waiting for
 * outstanding overlap gradients) and L2L's wait for a layer's update (`wait_params`, a phase
 * of load_layer). The measured bubble of a stage is their share of its step.
 */
export const WAITING_LABELS: ReadonlySet<string> = new Set([
  ...(Object.keys(OPS) as Array<Action['op']>).filter((op) => OPS[op].waits),
  'wait_params',
]);

/** Milliseconds of `trace` spent waiting (see {@link WAITING_LABELS}). */
export function waitingMs(trace: readonly TraceSpan[]): number {
  return trace
    .filter((t) => WAITING_LABELS.has(t.label))
    .reduce((a, t) => a + (t.end - t.start), 0);
}

/** Ops the executor's core runs itself (communication); every other op is a stage kind's compute (schedule/ops.ts CORE_OPS). */
export const COMMUNICATION_OPS = CORE_OPS;
export type CommunicationOp = CoreOp;
export type { ActionOf, ComputeOp };

/**
 * What a compute handler sees of the step: the step's mailboxes (taking a tensor passes its
 * ownership to the handler; putting one passes it to the executor) and its scalars.
 */
export interface StepIO {
  /** Micro-batches M of this step. */
  readonly m: number;
  /**
   * The gradient the last stage seeds each micro-batch's backward with: the loss scale (1, or
   * f16's dynamic loss scale S) over the micro-batches the mini-batch loss averages (M, times
   * the replicas R of a data-parallel run): S / (M R). Parameter gradients come out S times
   * the mini-batch gradient; the step divides by S.
   */
  readonly lossSeed: number;
  /** Learning rate of this step. */
  readonly lr: number;
  /** Global clipping scale from the step's reduce_grad_norm (1 before it; NaN: a numeric fault, update nothing). */
  readonly scale: number;
  /** Whether this step diagnoses a numeric fault (see {@link StepInputs.diagnose}). */
  readonly diagnose: boolean;
  /** Blocks this step skips (see {@link StepInputs.dropped}); empty for most steps. */
  readonly dropped: ReadonlySet<number>;
  /** Where the step's micro-batches sit, for training-time noise (see {@link StepInputs.noise}). */
  readonly noise?: StepNoise;
  /** Takes micro-batch mb's input: the step's input on the first stage, else the received activation. Throws if absent. */
  takeInput(mb: number): tf.Tensor;
  /** Takes micro-batch mb's labels. Throws if this stage was given none. */
  takeLabels(mb: number): tf.Tensor;
  /** Takes micro-batch mb's labels if this stage was given labels, else null. */
  takeLabelsIfAny(mb: number): tf.Tensor | null;
  /** Puts micro-batch mb's output, for the next send_act. */
  putOutput(mb: number, t: tf.Tensor): void;
  /** Takes the received gradient of micro-batch mb's output. Throws if absent. */
  takeOutputGrad(mb: number): tf.Tensor;
  /** Puts the gradient of micro-batch mb's input, for the next send_grad. */
  putInputGrad(mb: number, t: tf.Tensor): void;
  /** Hands a layer's gradient to the parameter server (L2L). Throws when the stage has no such link. */
  pushGrads(g: LayerGrads): void;
  /**
   * Marks the first `ms` milliseconds of the current action as `label` in the trace (the rest
   * is labelled `rest`, default the op): e.g. `recompute` within a backward.
   */
  phase(label: string, ms: number, rest?: string): void;
  /**
   * The current action queued GPU work: submit it now (so the GPU runs it while the host goes
   * on) and, where the stage traces its GPU ({@link StageProgram.traceGpu}), record when the GPU
   * finished it (a span with `gpu`). No-op on backends without a GPU queue (everything but webgpu).
   */
  gpuWork(): void;
}

/** A compute handler: runs one action of its op on the stage. */
export type Handler<K extends ComputeOp> = (
  a: ActionOf<K>,
  io: StepIO,
) => void | Promise<void>;

/** The handler table of a stage kind: which compute ops it runs, and how. */
export type Handlers = { [K in ComputeOp]?: Handler<K> };

/**
 * One stage kind's program on one device, as the executor and the device worker see it. Stage
 * kinds: pipeline/stage.ts (backprop: gpipe, 1F1B, single), pipeline/local-stage.ts (local
 * parallelism), pipeline/relay-stage.ts (L2L).
 */
export interface StageProgram {
  /** Name of the kind in messages, e.g. 'backprop stage'. */
  readonly kind: string;
  /** The compute ops this kind runs. */
  readonly handlers: Handlers;
  /**
   * Record the GPU's execution of the actions whose handlers call {@link StepIO.gpuWork}
   * (webgpu): one `GPUQueue.onSubmittedWorkDone` per such action, and one turn of the event loop
   * before each action while one is outstanding (about 0.3-0.5 ms each), so it is asked for only
   * when a trace is written.
   */
  readonly traceGpu?: boolean;
  /** Loss of each micro-batch recorded in this step (the model's, or a local loss), by micro-batch. */
  readonly losses: Map<number, number>;
  /** Evaluation metrics of each micro-batch (last stage, evaluation schedules; model/model.ts Model.metrics). */
  readonly metrics?: Map<number, Record<string, number>>;
  /** This stage's share of the global squared gradient norm (for reduce_grad_norm); NaN when its loss is not finite. */
  gradSquaredNorm?(): number | Promise<number>;
  /**
   * Data parallelism (all_reduce_grads): the accumulated gradients as host copies, in a fixed
   * order (every replica of the stage lists the same keys), and their replacement by the sums.
   */
  gradientValues?(): Promise<Float32Array[]>;
  setGradientValues?(values: readonly Float32Array[]): void;
  /** Non-finite values found by a diagnosing step (see {@link StepInputs.diagnose}); cleared with the losses. */
  readonly faults?: NumericFault[];
  /** Gradients this stage still expects from the next stage outside its schedule (for drain_grads). */
  pendingGradients?(): number;
  /** Drops every per-step tensor (after a failed step), keeping parameters and optimizer state. */
  reset(): void;
  /** Current parameter values (host copies); absent where the parameters live elsewhere (L2L: in the parameter server). */
  getParams?(): HostParams | Promise<HostParams>;
  /** Optimizer state; absent where it lives elsewhere. */
  getOptimizerState?(): OptimizerState | Promise<OptimizerState>;
  /** Reads what the step left pending on the device (losses, metrics, faults: pipeline/pending-reads.ts). */
  flush?(): Promise<void>;
  /** Drops what a failed step left pending, unread. */
  discard?(): void;
  setOptimizerState?(s: OptimizerState): void;
  /** Frees everything on the device. */
  dispose(): void;
}

/**
 * An action failed: `message` is the cause's; {@link stage} is the failing action's stage,
 * {@link index} its position in its device's list, and {@link schedule} shows the device's
 * actions with the failing one marked. `cause` is the original error.
 */
export class ScheduleError extends Error {
  override readonly name: string;
  constructor(
    override readonly cause: Error,
    readonly stage: number,
    readonly index: number,
    readonly schedule: string,
  ) {
    super(cause.message);
    this.name = cause.name; // a DeviceOutOfMemoryError stays recognisable by name
    this.stack = `${cause.stack ?? cause.message}\n${schedule}`;
  }
}

/** The step's tensors between actions, keyed by stage and micro-batch. */
class Mailbox {
  private readonly m = new Map<string, tf.Tensor>();
  constructor(private readonly what: string) {}
  put(stage: number, mb: number, t: tf.Tensor): void {
    const key = `${stage}:${mb}`;
    if (this.m.has(key))
      throw new Error(
        `${this.what} of stage ${stage}, micro-batch ${mb} is already waiting (schedule out of order)`,
      );
    this.m.set(key, t);
  }
  take(stage: number, mb: number, by: string): tf.Tensor {
    const key = `${stage}:${mb}`;
    const t = this.m.get(key);
    if (!t)
      throw new Error(
        `${by} of stage ${stage}, micro-batch ${mb}: no ${this.what} to use (schedule out of order)`,
      );
    this.m.delete(key);
    return t;
  }
  dispose(): void {
    for (const t of this.m.values()) t.dispose();
    this.m.clear();
  }
}

function handlerFor(program: StageProgram, op: ComputeOp): Handler<ComputeOp> {
  const h = program.handlers[op] as Handler<ComputeOp> | undefined;
  if (!h)
    throw new Error(
      `a ${program.kind} has no '${op}' action; the schedule does not fit this stage kind`,
    );
  return h;
}

/**
 * The programs of a device by stage: a map as given, or one program for every stage the
 * device's actions name (a device that runs one stage).
 */
function programsOf(
  programs: StageProgram | ReadonlyMap<number, StageProgram>,
  actions: readonly Action[],
): ReadonlyMap<number, StageProgram> {
  if (programs instanceof Map) return programs;
  const one = programs as StageProgram;
  return new Map(actions.map((a) => [a.stage, one]));
}

/** Throws when a received message is of micro-batch `got` where the schedule expects `want`. */
function expectMb(got: number, want: number, what: string): void {
  if (got !== want)
    throw new Error(
      `stage received the ${what} of micro-batch ${got} while its schedule expects ${want}`,
    );
}

/** The first `ms` of the current action as `label`, the rest as `rest` (default the op): see {@link StepIO.phase}. */
type Split = { label: string; ms: number; rest?: string };

/**
 * One step of one device: its programs by stage, the step's mailboxes, the action running
 * now, the clipping scale, the GPU marks and the trace so far. The core ops run here; compute
 * ops through their stage kind's handler with {@link io}.
 */
class StepRun {
  /** When the step began (`performance.now()`, ms): trace times count from it. */
  readonly t0 = performance.now();
  readonly trace: TraceSpan[] = [];
  private readonly byStage: ReadonlyMap<number, StageProgram>;
  /** This device's programs, each once, in the order of their stages. */
  private readonly own: StageProgram[];
  private readonly inputs = new Mailbox('input');
  private readonly labels = new Mailbox('labels');
  private readonly outputs = new Mailbox('output');
  private readonly outputGrads = new Mailbox('output gradient');
  private readonly inputGrads = new Mailbox('input gradient');
  /** Global clipping scale from reduce_grad_norm (1 before it). */
  private scale = 1;
  /** The current action's phases, if its handler marked one. */
  private split: Split | null = null;
  /** The current action: its op, stage and itself (null before the first). */
  private current: Action['op'] = 'forward';
  private stage: number;
  private action: Action | null = null;
  /** The GPU's command queue (webgpu), else null. */
  readonly gpu: GpuQueue | null;
  /** Whether the GPU's execution is traced (webgpu, a program asking for it). */
  readonly timeline: boolean;
  readonly gpuMarks: Array<{ a: Action; s: GpuSubmit }> = [];
  /** GPU marks whose work the GPU has not reported done yet. */
  outstanding = 0;
  /** What compute handlers see of the step. */
  private readonly io: StepIO;
  private readonly links: StageLinks;

  /**
   * The step of `actions` on `programs` (see {@link execute}) with `links` and its inputs `inp`:
   * the inputs go to the device's first stage's mailbox, the labels to the labels' mailbox.
   */
  constructor(
    programs: StageProgram | ReadonlyMap<number, StageProgram>,
    actions: readonly Action[],
    links: StageLinks,
    inp: StepInputs,
  ) {
    this.links = links;
    const byStage = programsOf(programs, actions);
    this.byStage = byStage;
    const firstStage = Math.min(...byStage.keys());
    // this device's programs, each once, in the order of their stages (stage-host builds the map
    // in ascending stage order, so replicas of a device list them alike)
    this.own = [...new Set(byStage.values())];
    inp.inputs?.forEach((t, mb) => t && this.inputs.put(firstStage, mb, t));
    inp.labels?.forEach((t, mb) => t && this.labels.put(-1, mb, t));
    this.stage = firstStage;
    this.gpu = gpuQueue();
    this.timeline =
      this.gpu !== null &&
      [...byStage.values()].some((p) => p.traceGpu === true);
    this.io = this.stepIO(inp);
  }

  /** What compute handlers see of the step: its scalars and mailboxes, as of the current action. */
  private stepIO(inp: StepInputs): StepIO {
    const run = this;
    const { inputs, labels, outputs, outputGrads, inputGrads, byStage } = this;
    const hasLabels = (inp.labels?.length ?? 0) > 0;
    return {
      m: inp.m,
      lossSeed: (inp.lossScale ?? 1) / (inp.m * (inp.replicas ?? 1)),
      lr: inp.lr,
      diagnose: inp.diagnose === true,
      dropped: new Set(inp.dropped ?? []),
      noise: inp.noise,
      get scale() {
        return run.scale;
      },
      takeInput: (mb) => inputs.take(run.stage, mb, run.current),
      takeLabels: (mb) => labels.take(-1, mb, run.current),
      takeLabelsIfAny: (mb) =>
        hasLabels ? labels.take(-1, mb, run.current) : null,
      putOutput: (mb, t) =>
        // the next stage on this device takes it directly
        byStage.has(run.stage + 1)
          ? inputs.put(run.stage + 1, mb, t)
          : outputs.put(run.stage, mb, t),
      takeOutputGrad: (mb) => outputGrads.take(run.stage, mb, run.current),
      putInputGrad: (mb, t) =>
        byStage.has(run.stage - 1)
          ? outputGrads.put(run.stage - 1, mb, t)
          : inputGrads.put(run.stage, mb, t),
      pushGrads(g) {
        if (!run.links.pushGrads)
          throw new Error(
            `${run.current} needs a link to the parameter server`,
          );
        run.links.pushGrads(g);
      },
      phase(label, ms, rest) {
        run.split = { label, ms, rest };
      },
      gpuWork: () => this.gpuWork(),
    };
  }

  /** {@link StepIO.gpuWork}: submits the current action's GPU work, marking it where the GPU is traced. */
  private gpuWork(): void {
    const gpu = this.gpu;
    if (!gpu || !this.action) return;
    if (!this.timeline) {
      gpu.flush();
      return;
    }
    const s = gpu.submit();
    this.outstanding++;
    void s.done.then(() => this.outstanding--);
    this.gpuMarks.push({ a: this.action, s });
  }

  /** Makes `a` the current action (its op, stage and no phases yet). */
  begin(a: Action): void {
    this.current = a.op;
    this.stage = a.stage;
    this.action = a;
    this.split = null;
  }

  /** The program of `stage`. Throws when the stage does not run on this device. */
  private programOf(stage: number): StageProgram {
    const p = this.byStage.get(stage);
    if (!p) throw new Error(`stage ${stage} does not run on this device`);
    return p;
  }

  /**
   * Runs action `a`: a communication op in the core, a compute op through its program's
   * handler. Throws when its op has no declaration (schedule/ops.ts), its stage no program
   * here, its program no handler for it, or it fails.
   */
  run(a: Action): void | Promise<void> {
    const core = declarationOf(a.op).core; // an op nobody declared is an error, never free
    const program = this.programOf(a.stage);
    switch (core ? a.op : 'compute') {
      case 'recv_act':
        return this.recvActivation(a as ActionOf<'recv_act'>);
      case 'send_act': {
        const mb = (a as ActionOf<'send_act'>).mb;
        const t = this.outputs.take(a.stage, mb, a.op);
        return this.links.sendActivation(a.stage, mb, t);
      }
      case 'recv_grad':
        return this.recvGradient(a as ActionOf<'recv_grad'>);
      case 'send_grad': {
        const mb = (a as ActionOf<'send_grad'>).mb;
        const t = this.inputGrads.take(a.stage, mb, a.op);
        return this.links.sendGradient(a.stage, mb, t);
      }
      case 'reduce_grad_norm':
        return this.reduceGradNorm();
      case 'all_reduce_grads':
        return this.allReduceGrads();
      case 'poll_grads':
        return this.pollGrads(a.stage);
      case 'drain_grads':
        return this.drainGrads(a.stage, program);
      default:
        return handlerFor(program, a.op as ComputeOp)(
          a as ActionOf<ComputeOp>,
          this.io,
        );
    }
  }

  /** recv_act: the next activation into the stage's input mailbox; throws when it is not of `a`'s micro-batch. */
  private async recvActivation(a: ActionOf<'recv_act'>): Promise<void> {
    const { mb, t } = await this.links.recvActivation(a.stage);
    this.inputs.put(a.stage, mb, t);
    expectMb(mb, a.mb, 'activation');
  }

  /** recv_grad: the next output gradient into the stage's mailbox; throws when it is not of `a`'s micro-batch. */
  private async recvGradient(a: ActionOf<'recv_grad'>): Promise<void> {
    const { mb, t } = await this.links.recvGradient(a.stage);
    this.outputGrads.put(a.stage, mb, t);
    expectMb(mb, a.mb, 'gradient');
  }

  /**
   * reduce_grad_norm: this device's share of the squared gradient norm (the sum over its
   * programs, each once; its own span `grad_norm`), all-reduced into the step's clipping scale.
   * Throws when a program cannot take part.
   */
  private async reduceGradNorm(): Promise<void> {
    const cannot = this.own.find((p) => !p.gradSquaredNorm);
    if (cannot)
      throw new Error(
        `a ${cannot.kind} cannot take part in the gradient-norm all-reduce`,
      );
    // computing this device's own sum of squares is work, not waiting: its own span
    const t = performance.now();
    let local = 0;
    for (const p of this.own) local += await p.gradSquaredNorm!();
    const ms = performance.now() - t;
    this.scale = await this.links.reduceGradNorm(local);
    this.split = { label: 'grad_norm', ms, rest: 'reduce_grad_norm' };
  }

  /**
   * all_reduce_grads: every program's gradients summed across the replicas in one all-reduce,
   * then set back. Throws without replica links, or when a program cannot take part.
   */
  private async allReduceGrads(): Promise<void> {
    if (!this.links.allReduce)
      throw new Error('all_reduce_grads needs links to the replicas');
    // every stage of this device: one all-reduce of all their gradients
    const cannot = this.own.find(
      (p) => !p.gradientValues || !p.setGradientValues,
    );
    if (cannot)
      throw new Error(
        `a ${cannot.kind} cannot take part in the gradient all-reduce`,
      );
    const parts: Float32Array[][] = [];
    for (const p of this.own) parts.push(await p.gradientValues!());
    await this.links.allReduce(parts.flat());
    this.own.forEach((p, i) => p.setGradientValues!(parts[i]!));
  }

  /** poll_grads: every gradient for `stage` that has arrived, each run through its overlap_backward. */
  private async pollGrads(stage: number): Promise<void> {
    for (
      let g = this.links.pollGradient(stage);
      g;
      g = this.links.pollGradient(stage)
    )
      await this.receivedGradient(stage, g);
  }

  /** drain_grads: waits for every gradient `program` still expects, each run through its overlap_backward. */
  private async drainGrads(
    stage: number,
    program: StageProgram,
  ): Promise<void> {
    while ((program.pendingGradients?.() ?? 0) > 0)
      await this.receivedGradient(stage, await this.links.recvGradient(stage));
  }

  /** Runs the overlap_backward of gradient `g` that stage `at` received. */
  private async receivedGradient(
    at: number,
    g: { mb: number; t: tf.Tensor },
  ): Promise<void> {
    this.outputGrads.put(at, g.mb, g.t);
    await handlerFor(this.programOf(at), 'overlap_backward')(
      { op: 'overlap_backward', stage: at, mb: g.mb },
      this.io,
    );
  }

  /** Frees every tensor still in the step's mailboxes (after a failed action). */
  disposeMailboxes(): void {
    for (const box of [
      this.inputs,
      this.labels,
      this.outputs,
      this.outputGrads,
      this.inputGrads,
    ])
      box.dispose();
  }

  /** Traces action `a`, run from `start` to `end` (ms since {@link t0}): one span, or two where it marked a phase. */
  record(a: Action, start: number, end: number): void {
    const at = {
      op: a.op,
      stage: a.stage,
      mb: 'mb' in a ? a.mb : -1,
      ...('layer' in a ? { layer: a.layer } : {}),
    };
    const s = this.split;
    if (s && s.ms > 0) {
      const mid = Math.min(start + s.ms, end); // a phase never outlasts its action
      this.trace.push({ label: s.label, ...at, start, end: mid });
      this.trace.push({ label: s.rest ?? a.op, ...at, start: mid, end });
    } else {
      this.trace.push({ label: a.op, ...at, start, end });
    }
  }
}

/**
 * Runs `actions`, device `device`'s list of one step, in order; each action runs on the program
 * of its stage (`programs`: by stage, or one program for the device's one stage). Receives must
 * match the schedule's micro-batch order (channels are FIFO); a mismatch is a schedule bug and
 * throws. Stages on this device hand their outputs and input gradients to each other directly
 * (the lowering put no send or receive between them). The step's inputs belong to the device's
 * first stage, its labels to whichever stage takes them. Returns the trace of the step. Throws
 * {@link ScheduleError} (the failing action marked in its schedule) when an action fails, an op
 * has no declaration (schedule/ops.ts) or a stage has no program here; tensors still in the
 * step's mailboxes are freed first.
 */
export async function execute(
  programs: StageProgram | ReadonlyMap<number, StageProgram>,
  actions: readonly Action[],
  links: StageLinks,
  inp: StepInputs,
  device = 0,
): Promise<TraceSpan[]> {
  const run = new StepRun(programs, actions, links, inp);
  for (let i = 0; i < actions.length; i++) {
    const a = actions[i];
    run.begin(a);
    if (run.timeline && run.outstanding > 0) await run.gpu!.poll(); // the GPU's finished work reported now, not at the next wait
    run.gpu?.begin();
    const start = performance.now() - run.t0;
    try {
      await run.run(a);
    } catch (e) {
      run.disposeMailboxes();
      const err = e instanceof Error ? e : new Error(String(e));
      throw new ScheduleError(
        err,
        a.stage,
        i,
        formatScheduleError(device, actions, i),
      );
    }
    run.record(a, start, performance.now() - run.t0);
  }
  if (run.gpuMarks.length > 0)
    run.trace.push(...(await gpuSpans(run.gpuMarks, run.t0)));
  return run.trace;
}

/**
 * The GPU's spans of the marked actions, in ms since `t0`: the GPU runs submitted work in
 * order, so an action's span starts at its first submit or when the GPU finished the previous
 * one, whichever is later, and ends when the GPU reported it done, or earlier where a read
 * completed after the action's last submit (waits for the last report).
 */
async function gpuSpans(
  marks: ReadonlyArray<{ a: Action; s: GpuSubmit }>,
  t0: number,
): Promise<TraceSpan[]> {
  const done = await Promise.all(marks.map((m) => m.s.done));
  const spans: TraceSpan[] = [];
  let prev = -Infinity;
  marks.forEach(({ a, s }, i) => {
    if (!Number.isFinite(done[i])) return; // the device was lost: no time to show
    const start = Math.max((s.firstSubmitAt ?? s.submittedAt) - t0, prev);
    // the done report comes a host turn or more late; a read that completed after the action's
    // last submit bounds the GPU's work sooner (a host stash's download waited for it)
    const end = Math.max(Math.min(done[i], s.idleBy ?? Infinity) - t0, start);
    prev = end;
    spans.push({
      label: a.op,
      op: a.op,
      stage: a.stage,
      mb: 'mb' in a ? a.mb : -1,
      ...('layer' in a ? { layer: a.layer } : {}),
      start,
      end,
      gpu: true,
      submitMs: s.submitMs,
    });
  });
  return spans;
}
