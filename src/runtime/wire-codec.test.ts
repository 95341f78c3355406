/** The WebSocket links' message encoding gives back what structured clone would. */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { decodeMessage, encodeMessage } from './wire-codec.js';

test('a protocol message survives the byte encoding: typed arrays, Maps, NaN, undefined', () => {
  const params = new Map([
    ['0/w', new Float32Array([1.5, -2, Number.NaN])],
    ['1/b', new Float32Array(0)],
  ]);
  const msg = {
    type: 'request',
    id: 7,
    method: 'init',
    args: {
      index: 1,
      backend: undefined,
      range: { from: 2, to: 4 },
      params,
      ids: new Int32Array([3, 1, 4, 1, 5]),
      raw: new Uint8Array([255, 0, 1]).buffer,
      odd: new Float32Array(new Float32Array([9, 8, 7, 6]).buffer, 4, 2),
      loss: Number.POSITIVE_INFINITY,
      nested: [null, true, 'x', [undefined, -0.25]],
    },
  };
  const back = decodeMessage(encodeMessage(msg)) as typeof msg;
  assert.deepEqual(back, structuredClone(msg));
  assert.ok(back.args.params.get('0/w') instanceof Float32Array);
  assert.deepEqual([...back.args.odd], [8, 7]);
  assert.ok(Object.hasOwn(back.args, 'backend'));
});

test('what the protocol never sends is refused, and bytes that are not a message throw', () => {
  assert.throws(() => encodeMessage({ f: () => 1 }), TypeError);
  assert.throws(() => encodeMessage({ d: new Date() }), TypeError);
  assert.throws(() => decodeMessage(new Uint8Array([1, 2])), /shorter/);
  const bytes = new Uint8Array(encodeMessage({ a: new Float32Array(4) }));
  assert.throws(() => decodeMessage(bytes.subarray(0, 12)), /overruns/);
});
