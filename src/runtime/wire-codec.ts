/**
 * The byte encoding of the device protocol's messages where Node's structured serializer
 * (v8.serialize, which the gRPC links use) is not on both ends: the WebSocket link between a
 * coordinator and a browser tab (runtime/browser-device.ts and web/device.ts). It carries what
 * structured clone carries in the protocol: plain objects and arrays, strings, booleans,
 * null and undefined, numbers (NaN and the infinities too), typed arrays and ArrayBuffers (as
 * raw bytes), and Maps. A message is one ArrayBuffer: a header (the JSON's byte length and the
 * number of binary values, 32-bit little-endian), the JSON of the message with every binary
 * value replaced by a tagged reference, a table of (offset, length) per binary value, then the
 * values, each at an 8-byte-aligned offset. Pure: no Node or browser API beyond
 * TextEncoder/TextDecoder.
 */

const TAG = '$lw';

/** Typed array constructors by name: what crosses the wire. */
const TYPED = {
  Float32Array,
  Float64Array,
  Int32Array,
  Uint32Array,
  Int16Array,
  Uint16Array,
  Int8Array,
  Uint8Array,
  Uint8ClampedArray,
} as const;
type TypedName = keyof typeof TYPED;

const align8 = (n: number) => (n + 7) & ~7;

/**
 * Encodes `value` as one ArrayBuffer. Throws TypeError for what the protocol never sends
 * (functions, symbols, bigints, MessagePorts and other class instances).
 */
export function encodeMessage(value: unknown): ArrayBuffer {
  const blobs: Uint8Array[] = [];
  const walk = (v: unknown): unknown => {
    if (v === undefined) return { [TAG]: 'u' };
    if (typeof v === 'number')
      return Number.isFinite(v) ? v : { [TAG]: 'n', v: String(v) };
    if (v === null || typeof v === 'string' || typeof v === 'boolean') return v;
    if (typeof v !== 'object')
      throw new TypeError(`cannot send a ${typeof v} to a browser device`);
    if (ArrayBuffer.isView(v)) {
      const name = v.constructor.name as TypedName;
      if (!(name in TYPED))
        throw new TypeError(`cannot send a ${name} to a browser device`);
      blobs.push(new Uint8Array(v.buffer, v.byteOffset, v.byteLength));
      return { [TAG]: 't', c: name, i: blobs.length - 1 };
    }
    if (v instanceof ArrayBuffer) {
      blobs.push(new Uint8Array(v));
      return { [TAG]: 'b', i: blobs.length - 1 };
    }
    if (Array.isArray(v)) return v.map(walk);
    if (v instanceof Map)
      return { [TAG]: 'm', e: [...v].map(([k, x]) => [walk(k), walk(x)]) };
    const proto = Object.getPrototypeOf(v);
    if (proto !== Object.prototype && proto !== null)
      throw new TypeError(
        `cannot send a ${(v as object).constructor?.name ?? 'class instance'} to a browser device`,
      );
    const out: Record<string, unknown> = {};
    for (const [k, x] of Object.entries(v)) out[k] = walk(x);
    return out;
  };
  const json = new TextEncoder().encode(JSON.stringify(walk(value)));
  // header (JSON length, binary value count), JSON, table (offset, length per value), values
  const table = align8(8 + json.length);
  let size = table + 8 * blobs.length;
  const offsets = blobs.map((b) => {
    const at = align8(size);
    size = at + b.byteLength;
    return at;
  });
  const out = new Uint8Array(align8(size));
  const view = new DataView(out.buffer);
  view.setUint32(0, json.length, true);
  view.setUint32(4, blobs.length, true);
  out.set(json, 8);
  blobs.forEach((b, i) => {
    out.set(b, offsets[i]!);
    view.setUint32(table + 8 * i, offsets[i]!, true);
    view.setUint32(table + 8 * i + 4, b.byteLength, true);
  });
  return out.buffer;
}

/**
 * Decodes what {@link encodeMessage} made. Typed arrays get buffers of their own (copies).
 * Throws Error for bytes that are not such a message.
 */
export function decodeMessage(bytes: ArrayBuffer | ArrayBufferView): unknown {
  const u8 = ArrayBuffer.isView(bytes)
    ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength)
    : new Uint8Array(bytes);
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  if (u8.length < 8) throw new Error('a device message shorter than 8 bytes');
  const jsonLength = view.getUint32(0, true);
  const count = view.getUint32(4, true);
  const table = align8(8 + jsonLength);
  if (table + 8 * count > u8.length)
    throw new Error('a device message whose header overruns it');
  const tree = JSON.parse(
    new TextDecoder().decode(u8.subarray(8, 8 + jsonLength)),
  ) as unknown;
  const blob = (i: number): ArrayBuffer => {
    if (!(i >= 0 && i < count))
      throw new Error(`a device message without its binary value ${i}`);
    const at = view.getUint32(table + 8 * i, true);
    const len = view.getUint32(table + 8 * i + 4, true);
    if (at + len > u8.length)
      throw new Error('a device message whose binary value overruns it');
    return u8.slice(at, at + len).buffer;
  };
  const walk = (v: unknown): unknown => {
    if (v === null || typeof v !== 'object') return v;
    if (Array.isArray(v)) return v.map(walk);
    const o = v as Record<string, unknown>;
    switch (o[TAG]) {
      case 'u':
        return undefined;
      case 'n':
        return Number(o.v);
      case 't': {
        const C = TYPED[o.c as TypedName];
        if (!C) throw new Error(`a device message with a ${String(o.c)}`);
        return new C(blob(o.i as number));
      }
      case 'b':
        return blob(o.i as number);
      case 'm':
        return new Map(
          (o.e as Array<[unknown, unknown]>).map(([k, x]) => [
            walk(k),
            walk(x),
          ]),
        );
    }
    const out: Record<string, unknown> = {};
    for (const [k, x] of Object.entries(o)) out[k] = walk(x);
    return out;
  };
  return walk(tree);
}
