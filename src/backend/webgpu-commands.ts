/**
 * A webgpu step's GPU commands as Dawn receives them (compute passes, pipelines, bind groups,
 * dispatches, buffer copies, the queue's writes and submits), recorded, compared and encoded
 * again without TF.js: what a captured step (pipeline/captured-step.ts) re-issues in place of
 * TF.js's programs, as CUDA graphs re-issue a captured stream, and what `npm run bench --
 * webgpu-host` measures as the host's floor for a step (bench/webgpu-replay.ts). A recording
 * holds the objects themselves (a bind group keeps its buffers alive in Dawn), so replaying it
 * runs the same programs on the same buffers: their values when it runs are what it reads.
 */
/** The parts of Dawn's objects recorded or replayed here. */
interface Pass {
  setPipeline(p: object): void;
  setBindGroup(i: number, g: object, ...rest: unknown[]): void;
  dispatchWorkgroups(x: number, y?: number, z?: number): void;
  end(): void;
}
interface Encoder {
  beginComputePass(d?: object): Pass;
  copyBufferToBuffer(
    src: { usage: number },
    srcOffset: number,
    dst: { usage: number },
    dstOffset: number,
    size: number,
  ): void;
  finish(): object;
}
interface Buffer {
  usage: number;
  getMappedRange(offset?: number, size?: number): ArrayBuffer;
  unmap(): void;
}
export interface Device {
  createCommandEncoder(d?: object): Encoder;
  createBuffer(d: {
    size: number;
    usage: number;
    mappedAtCreation?: boolean;
  }): Buffer;
  queue: {
    submit(buffers: object[]): void;
    writeBuffer(b: object, offset: number, data: ArrayBufferView): void;
  };
  pushErrorScope(filter: 'validation'): void;
  popErrorScope(): Promise<{ message: string } | null>;
}

/** One recorded command. */
export type RecordedOp =
  | { op: 'begin' }
  | { op: 'pipeline'; pipeline: object }
  | { op: 'bind'; index: number; group: object; rest: unknown[] }
  | { op: 'dispatch'; x: number; y?: number; z?: number }
  | { op: 'end' }
  | {
      op: 'copy';
      args: Parameters<Encoder['copyBufferToBuffer']>;
      /** An upload's bytes: what the mapped staging buffer it copies from held. */
      data?: Uint8Array;
    }
  | { op: 'write'; buffer: object; offset: number; data: Uint8Array }
  | { op: 'submit' };

const MAP_READ = 0x01;
const MAP_WRITE = 0x02;
const COPY_SRC = 0x04;
const COPY_DST = 0x08;

/** Whether `o` is an upload: a copy from a staging buffer the host wrote (mappable for writing). */
export const isUpload = (o: RecordedOp): boolean =>
  o.op === 'copy' && (o.args[0].usage & MAP_WRITE) !== 0;

/** Whether `o` is a read's copy: into a buffer the host maps to read. */
export const isRead = (o: RecordedOp): boolean =>
  o.op === 'copy' && (o.args[2].usage & MAP_READ) !== 0;

/**
 * Records the commands `device` receives while `run` runs (`run` must submit all it records; the
 * op list starts at the first command encoder made after the call), and the queue's
 * `writeBuffer`s among them. An upload (a copy from a staging buffer mapped at its creation)
 * keeps the staging buffer's bytes. Restores the device's methods before returning.
 */
export function recordCommands(device: object, run: () => void): RecordedOp[] {
  const recording = startRecording(device);
  try {
    run();
  } finally {
    recording.stop();
  }
  return recording.ops;
}

/** A recording in progress ({@link startRecording}). */
export interface Recording {
  /** The commands so far. */
  ops: RecordedOp[];
  /** Ends the recording (the device's methods restored) and returns its commands. */
  stop(): RecordedOp[];
}

/**
 * Starts recording the commands `device` receives, as {@link recordCommands} does, until the
 * returned recording's `stop()`: for a recording that spans several calls (a step's actions).
 * One recording at a time on a device.
 */
export function startRecording(device: object): Recording {
  const d = device as Device;
  const ops: RecordedOp[] = [];
  const create = d.createCommandEncoder;
  const submit = d.queue.submit;
  const write = d.queue.writeBuffer;
  const createBuffer = d.createBuffer;
  // the bytes each staging buffer mapped at creation held when it was unmapped
  const staged = new WeakMap<object, Uint8Array>();
  d.createBuffer = (desc) => {
    const b = createBuffer.call(d, desc);
    if (desc.mappedAtCreation) {
      const ranges: ArrayBuffer[] = [];
      const range = b.getMappedRange.bind(b);
      const unmap = b.unmap.bind(b);
      b.getMappedRange = (offset?: number, size?: number) => {
        const r = range(offset, size);
        ranges.push(r);
        return r;
      };
      b.unmap = () => {
        if (ranges.length === 1)
          staged.set(b, new Uint8Array(ranges[0]!).slice());
        unmap();
      };
    }
    return b;
  };
  d.queue.writeBuffer = (buffer, offset, data) => {
    const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    ops.push({ op: 'write', buffer, offset, data: bytes.slice() });
    write.call(d.queue, buffer, offset, data);
  };
  d.createCommandEncoder = (desc?: object) => {
    const e = create.call(d, desc);
    const begin = e.beginComputePass.bind(e);
    e.beginComputePass = (pd?: object) => {
      ops.push({ op: 'begin' });
      const p = begin(pd);
      const [setPipeline, setBindGroup, dispatch, end] = [
        p.setPipeline.bind(p),
        p.setBindGroup.bind(p),
        p.dispatchWorkgroups.bind(p),
        p.end.bind(p),
      ];
      p.setPipeline = (pipeline) => {
        ops.push({ op: 'pipeline', pipeline });
        setPipeline(pipeline);
      };
      p.setBindGroup = (index, group, ...rest) => {
        ops.push({ op: 'bind', index, group, rest });
        setBindGroup(index, group, ...rest);
      };
      p.dispatchWorkgroups = (x, y, z) => {
        ops.push({ op: 'dispatch', x, y, z });
        dispatch(x, y, z);
      };
      p.end = () => {
        ops.push({ op: 'end' });
        end();
      };
      return p;
    };
    const copy = e.copyBufferToBuffer.bind(e);
    e.copyBufferToBuffer = (...args) => {
      const data = staged.get(args[0]);
      ops.push(data ? { op: 'copy', args, data } : { op: 'copy', args });
      copy(...args);
    };
    return e;
  };
  d.queue.submit = (buffers: object[]) => {
    if (buffers.length > 0) ops.push({ op: 'submit' });
    submit.call(d.queue, buffers);
  };
  return {
    ops,
    stop() {
      d.createCommandEncoder = create;
      d.queue.submit = submit;
      d.queue.writeBuffer = write;
      d.createBuffer = createBuffer;
      return ops;
    },
  };
}

/**
 * What a replay writes where the recording wrote a step's own values: by default none (a
 * measurement: uploads and `writeBuffer`s left out, the buffers keep what they hold). The
 * captured step (pipeline/captured-step.ts) gives the batch's tokens and labels and the loss seed.
 */
export interface ReplayInputs {
  /** The bytes of the recording's upload number `i` (0-based, in order): the step's batch, and its scalars. */
  upload(i: number, recorded: Uint8Array): Uint8Array;
  /** The bytes of the recording's `writeBuffer` number `i`: e.g. AdamW's uniforms, its step count in them. */
  write(i: number, recorded: Uint8Array): Uint8Array;
}

/**
 * Whether two recorded commands are the same command on the same objects (pipeline, bind group,
 * buffers: by identity) with the same numbers: what a step must repeat of the step before for
 * its recording to stand for it.
 */
export function sameCommand(o: RecordedOp, p: RecordedOp): boolean {
  if (o.op !== p.op) return false;
  switch (o.op) {
    case 'pipeline':
      return o.pipeline === (p as typeof o).pipeline;
    case 'bind': {
      const q = p as typeof o;
      return (
        o.index === q.index &&
        o.group === q.group &&
        o.rest.length === q.rest.length &&
        o.rest.every((x, k) => x === q.rest[k])
      );
    }
    case 'dispatch': {
      const q = p as typeof o;
      return o.x === q.x && o.y === q.y && o.z === q.z;
    }
    case 'copy':
      return o.args.every((x, k) => x === (p as typeof o).args[k]);
    case 'write': {
      // the bytes are the step's own (a batch, a step count): the place must be the same
      const q = p as typeof o;
      return (
        o.buffer === q.buffer &&
        o.offset === q.offset &&
        o.data.byteLength === q.data.byteLength
      );
    }
    default:
      return true;
  }
}

/**
 * The staging buffer upload i copies `data` from: `staging[i]` (made there the first time),
 * written with `queue.writeBuffer`, or, without `staging`, a new one mapped at creation.
 */
function stagingOf(
  d: Device,
  data: Uint8Array,
  i: number,
  staging: object[] | undefined,
): object {
  if (staging) {
    const b = (staging[i] ??= d.createBuffer({
      size: data.byteLength,
      usage: COPY_SRC | COPY_DST,
    }));
    d.queue.writeBuffer(b, 0, data);
    return b;
  }
  const b = d.createBuffer({
    size: data.byteLength,
    usage: MAP_WRITE | COPY_SRC,
    mappedAtCreation: true,
  });
  new Uint8Array(b.getMappedRange()).set(data);
  b.unmap();
  return b;
}

/** What a replay submitted: its compute dispatches, buffer copies and queue submits. */
export interface ReplayedCounts {
  dispatches: number;
  copies: number;
  submits: number;
}

/** How {@link replayCommands} replays. */
export interface ReplayOptions {
  /** A step's own values for the uploads and writes; absent: both left out (a measurement). */
  inputs?: ReplayInputs;
  /**
   * Staging buffers kept by the caller from replay to replay: upload i's is `staging[i]`, made
   * there the first time. Absent: a new one mapped at creation per upload, as TF.js uploads.
   */
  staging?: object[];
  /** Called with each command encoder the replay makes, before it records anything (a pass timer's hook). */
  onEncoder?: (encoder: object) => void;
}

/**
 * Encodes and submits `ops` again on `device`. Reads' copies (to mappable buffers) are left out.
 * Without `inputs`, so are the uploads and `writeBuffer`s; with it, each upload is copied, in its
 * place, from a staging buffer holding `inputs.upload`'s bytes, and each `writeBuffer` writes
 * `inputs.write`'s. A kept staging buffer is written with `queue.writeBuffer`, which the queue
 * runs before this replay's commands and after all submitted before. Returns what it submitted.
 * @throws Error where an input's bytes are not as many as the recording's.
 */
export function replayCommands(
  device: object,
  ops: readonly RecordedOp[],
  { inputs, staging, onEncoder }: ReplayOptions = {},
): ReplayedCounts {
  const d = device as Device;
  const counts: ReplayedCounts = { dispatches: 0, copies: 0, submits: 0 };
  const encoder = () => {
    const e = d.createCommandEncoder();
    onEncoder?.(e);
    return e;
  };
  let uploads = 0;
  let writes = 0;
  const sized = (data: Uint8Array, recorded: Uint8Array, what: string) => {
    if (data.byteLength !== recorded.byteLength)
      throw new Error(
        `replayCommands: ${what} has ${data.byteLength} bytes where the recording has ${recorded.byteLength}`,
      );
    return data;
  };
  let e = encoder();
  let pass: Pass | null = null;
  const close = () => {
    pass?.end();
    pass = null;
  };
  for (const o of ops)
    switch (o.op) {
      case 'begin':
        close();
        pass = e.beginComputePass();
        break;
      case 'pipeline':
        pass!.setPipeline(o.pipeline);
        break;
      case 'bind':
        pass!.setBindGroup(o.index, o.group, ...o.rest);
        break;
      case 'dispatch':
        pass!.dispatchWorkgroups(o.x, o.y, o.z);
        counts.dispatches++;
        break;
      case 'end':
        close();
        break;
      case 'copy': {
        const [, , dst, dstOffset, size] = o.args;
        if (isRead(o)) break;
        if (isUpload(o)) {
          if (!inputs || !o.data) break;
          const i = uploads++;
          const data = sized(inputs.upload(i, o.data), o.data, `upload ${i}`);
          const from = stagingOf(d, data, i, staging);
          close();
          e.copyBufferToBuffer(
            from as { usage: number },
            0,
            dst,
            dstOffset,
            size,
          );
          counts.copies++;
          break;
        }
        close();
        e.copyBufferToBuffer(...o.args);
        counts.copies++;
        break;
      }
      case 'write': {
        if (!inputs) break;
        const i = writes++;
        const data = sized(inputs.write(i, o.data), o.data, `write ${i}`);
        d.queue.writeBuffer(o.buffer, o.offset, data);
        break;
      }
      case 'submit':
        close();
        d.queue.submit([e.finish()]);
        counts.submits++;
        e = encoder();
        break;
    }
  close();
  d.queue.submit([e.finish()]);
  counts.submits++;
  return counts;
}
