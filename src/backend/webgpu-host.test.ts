/**
 * backend/webgpu-host.ts: the uniform cache packs exactly the bytes TF.js's own makeUniforms
 * writes (same size, same words, for fields of 1 to 6 components of each type, in orders that
 * exercise WGSL's alignment rules), writes each distinct contents once and hands the same buffer
 * back for the same contents; a pipeline answers getBindGroupLayout with one object per index;
 * bind groups are kept by layout and bound buffer ranges; buffers held for a captured step are
 * not handed out by the pool until given back. No GPU needed: the device and TF.js's
 * backend are stand-ins that record what is written (webgpu.test.ts runs the caches on a GPU).
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { WebGPUBackend } from '@tensorflow/tfjs-backend-webgpu';
import {
  bindGroupCountsOf,
  cutDispatchHostWork,
  holdBuffers,
  unholdBuffers,
} from './webgpu-host.js';

type Uniform = { type: 'int32' | 'uint32' | 'float32'; data: number[] };

/** A stand-in device that records its buffers and their writes. */
function fakeDevice() {
  const writes: Array<{ buffer: object; bytes: Uint8Array }> = [];
  let made = 0;
  const pipeline = () => ({ getBindGroupLayout: (_i: number) => ({}) });
  return {
    writes,
    made: () => made,
    device: {
      createBuffer: (d: { size: number }) => {
        made++;
        return { size: d.size, id: made };
      },
      createComputePipeline: (_d: unknown) => pipeline(),
      createBindGroup: (d: { layout: object; entries: unknown[] }) => ({
        ...d,
        made: ++made,
      }),
      createComputePipelineAsync: async (_d: unknown) => pipeline(),
      queue: {
        writeBuffer: (
          buffer: object,
          _offset: number,
          data: ArrayBuffer,
          dataOffset = 0,
          size?: number,
        ) =>
          writes.push({
            buffer,
            bytes: new Uint8Array(data.slice(dataOffset, size ?? undefined)),
          }),
      },
    },
  };
}

/** The bytes TF.js 4.22's own makeUniforms writes for `uniforms` (run on a stand-in backend). */
function stockBytes(uniforms: Uniform[]): Uint8Array {
  (globalThis as { GPUBufferUsage?: object }).GPUBufferUsage ??= {
    COPY_DST: 8,
    UNIFORM: 64,
  };
  const f = fakeDevice();
  const self = {
    bufferManager: { acquireBuffer: (size: number) => ({ size }) },
    queue: f.device.queue,
    uniformPendingDisposal: [] as unknown[],
  };
  (
    WebGPUBackend.prototype as unknown as {
      makeUniforms(this: unknown, u: Uniform[]): unknown;
    }
  ).makeUniforms.call(self, structuredClone(uniforms));
  return f.writes[0]!.bytes;
}

const CASES: Uniform[][] = [
  [
    { type: 'float32', data: [Number.NaN] },
    { type: 'float32', data: [Number.POSITIVE_INFINITY] },
    { type: 'int32', data: [8, 16] },
    { type: 'int32', data: [16, 1] },
    { type: 'int32', data: [4, 8, 16] },
    { type: 'int32', data: [128, 16, 1] },
    { type: 'int32', data: [512] },
  ],
  [
    { type: 'int32', data: [1, 2, 3, 4, 5] },
    { type: 'float32', data: [0.5] },
    { type: 'int32', data: [1, 2, 3, 4, 5, 6] },
    { type: 'uint32', data: [7, 9] },
    { type: 'float32', data: [-1e-3, 3.25, 2 ** -20, -7] },
  ],
  [
    { type: 'int32', data: [] },
    { type: 'uint32', data: [3] },
  ],
  [
    { type: 'int32', data: [1] },
    { type: 'int32', data: [2, 3] },
    { type: 'float32', data: [4] },
    { type: 'int32', data: [5, 6, 7] },
    { type: 'uint32', data: [8] },
  ],
  [
    { type: 'float32', data: [1.5, 2.5] },
    { type: 'int32', data: [-3, 4, 5] },
  ],
];

test("the uniform cache packs TF.js's bytes, writes each contents once and reuses its buffer", () => {
  const f = fakeDevice();
  const backend = {
    device: f.device,
    makeUniforms: (_u: Uniform[]): unknown => assert.fail('replaced'),
  };
  cutDispatchHostWork(backend);
  const seen: object[] = [];
  for (const uniforms of CASES) {
    const want = stockBytes(uniforms);
    const writes = f.writes.length;
    const got = backend.makeUniforms(structuredClone(uniforms)) as {
      offset: number;
      size: number;
      buffer: object;
    };
    assert.equal(got.offset, 0);
    assert.equal(got.size, want.byteLength, 'the struct size');
    assert.equal(f.writes.length, writes + 1, 'new contents: one write');
    assert.deepEqual(f.writes.at(-1)!.bytes, want, JSON.stringify(uniforms));
    assert.equal(f.writes.at(-1)!.buffer, got.buffer);
    // the same contents again: the same buffer, nothing written
    const again = backend.makeUniforms(structuredClone(uniforms)) as {
      buffer: object;
    };
    assert.equal(again.buffer, got.buffer);
    assert.equal(f.writes.length, writes + 1, 'same contents: no write');
    seen.push(got.buffer);
  }
  assert.equal(
    new Set(seen).size,
    CASES.length,
    'other contents, other buffers',
  );
  // one value changed: another buffer
  const changed = structuredClone(CASES[0]!);
  changed[6]!.data = [513];
  const other = backend.makeUniforms(changed) as { buffer: object };
  assert.ok(!seen.includes(other.buffer));
  assert.throws(
    () =>
      backend.makeUniforms([{ type: 'int32', data: [1, 2, 3, 4, 5, 6, 7] }]),
    /Unsupported 7D shape/,
  );
});

test('a pipeline made after the install answers getBindGroupLayout with one object per index', async () => {
  const f = fakeDevice();
  const backend = { device: f.device, makeUniforms: () => undefined };
  cutDispatchHostWork(backend);
  const p = f.device.createComputePipeline({});
  assert.equal(p.getBindGroupLayout(0), p.getBindGroupLayout(0));
  assert.notEqual(p.getBindGroupLayout(0), p.getBindGroupLayout(1));
  const q = await f.device.createComputePipelineAsync({});
  assert.equal(q.getBindGroupLayout(0), q.getBindGroupLayout(0));
  assert.notEqual(q.getBindGroupLayout(0), p.getBindGroupLayout(0));
});

test('bind groups are kept by layout and bound buffer ranges; other resources are made each time', () => {
  const f = fakeDevice();
  const backend = { device: f.device, makeUniforms: () => undefined };
  cutDispatchHostWork(backend);
  const layout = f.device.createComputePipeline({}).getBindGroupLayout(0);
  const other = f.device.createComputePipeline({}).getBindGroupLayout(0);
  const [a, b] = [
    f.device.createBuffer({ size: 64 }),
    f.device.createBuffer({ size: 64 }),
  ];
  const group = (l: object, entries: Array<[object, number?, number?]>) =>
    f.device.createBindGroup({
      layout: l,
      entries: entries.map(([buffer, offset, size], binding) => ({
        binding,
        resource: { buffer, offset, size },
      })),
    });
  const g = group(layout, [[a, 0, 64], [b]]);
  assert.equal(
    group(layout, [[a, 0, 64], [b]]),
    g,
    'the same layout and ranges',
  );
  assert.deepEqual(bindGroupCountsOf(f.device), { made: 1, found: 1 });
  const others = [
    group(other, [[a, 0, 64], [b]]),
    group(layout, [[b, 0, 64], [b]]),
    group(layout, [[a, 16, 48], [b]]),
    group(layout, [[a, 0, 32], [b]]),
    group(layout, [[a, 0, 64], [a]]),
    group(layout, [[a, 0, 64]]),
  ];
  assert.equal(
    new Set([g, ...others]).size,
    7,
    'another layout, buffer, offset, size or count',
  );
  const view = { binding: 0, resource: { label: 'a texture view' } };
  const t1 = f.device.createBindGroup({ layout, entries: [view] });
  const t2 = f.device.createBindGroup({ layout, entries: [view] });
  assert.notEqual(t1, t2, 'not a buffer: made each time');
  assert.deepEqual(bindGroupCountsOf(f.device), { made: 7, found: 1 });
});

/** A stand-in for TF.js 4.22's BufferManager (buffer_manager.ts): free lists by size and usage, pop the last. */
function fakePool(device: { createBuffer(d: { size: number }): object }) {
  const key = (size: number, usage: number) => `${size}_${usage}`;
  return {
    freeBuffers: new Map<string, object[]>(),
    numFreeBuffers: 0,
    acquireBuffer(size: number, usage: number) {
      const free = this.freeBuffers.get(key(size, usage)) ?? [];
      this.freeBuffers.set(key(size, usage), free);
      if (free.length > 0) {
        this.numFreeBuffers--;
        return free.pop()!;
      }
      return Object.assign(device.createBuffer({ size }), { usage });
    },
    releaseBuffer(b: { size: number; usage: number }, reuse = true) {
      if (!reuse) return;
      this.freeBuffers.get(key(b.size, b.usage))!.push(b);
      this.numFreeBuffers++;
    },
  };
}

test('buffers held for a captured step are not handed out by the pool, free when held or released later, until their owner gives them back; one owner at a time', () => {
  const f = fakeDevice();
  const pool = fakePool(f.device);
  const backend = {
    device: f.device,
    bufferManager: pool,
    makeUniforms: () => undefined,
  };
  cutDispatchHostWork(backend);
  const take = () =>
    pool.acquireBuffer(64, 140) as { size: number; usage: number };
  const [a, b] = [take(), take()];
  pool.releaseBuffer(a);
  const owner = {};
  assert.ok(holdBuffers(backend, owner, [a, b]));
  assert.equal(pool.numFreeBuffers, 0, 'a, free, taken out of the free list');
  const c = take();
  assert.ok(c !== a && c !== b, 'a new buffer, not a held one');
  pool.releaseBuffer(b); // released while held: kept out too
  pool.releaseBuffer(c);
  assert.equal(take(), c, 'the free one that is not held');
  assert.ok(!holdBuffers(backend, {}, [c]), 'another owner holds nothing');
  unholdBuffers(backend, {});
  assert.ok(![a, b].includes(take()), 'given back only by their owner');
  unholdBuffers(backend, owner);
  assert.equal(pool.numFreeBuffers, 2);
  assert.deepEqual([take(), take()], [a, b], 'back, the first made first');
});
