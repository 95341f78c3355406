/**
 * Reader for IDX files, the format of MNIST and Fashion-MNIST
 * (http://yann.lecun.com/exdb/mnist/): a 4-byte magic number `0x00 0x00 TYPE NDIMS`, then NDIMS
 * big-endian uint32 sizes, then the values in row-major order, big-endian. Files may be
 * gzip-compressed (detected from their content, not their name).
 */
import { readFile } from 'node:fs/promises';
import { gunzipSync } from 'node:zlib';
import { check, LayerwiseError } from '../util/errors.js';

/** Element types of IDX files, by their type byte: 0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64. */
export type IdxDtype =
  | 'uint8'
  | 'int8'
  | 'int16'
  | 'int32'
  | 'float32'
  | 'float64';

/** Typed array holding the values of an IDX file. */
export type IdxData =
  | Uint8Array
  | Int8Array
  | Int16Array
  | Int32Array
  | Float32Array
  | Float64Array;

/** A parsed IDX file. */
export interface IdxArray {
  dtype: IdxDtype;
  /** Sizes of each dimension, outermost first, e.g. [60000, 28, 28] for MNIST training images. */
  dims: number[];
  /** The values in row-major order (length = product of dims), in native byte order. */
  data: IdxData;
}

const TYPES: Record<number, { dtype: IdxDtype; bytes: number }> = {
  8: { dtype: 'uint8', bytes: 1 },
  9: { dtype: 'int8', bytes: 1 },
  11: { dtype: 'int16', bytes: 2 },
  12: { dtype: 'int32', bytes: 4 },
  13: { dtype: 'float32', bytes: 4 },
  14: { dtype: 'float64', bytes: 8 },
};

const TYPE_BYTES: Record<IdxDtype, number> = Object.fromEntries(
  Object.values(TYPES).map((t) => [t.dtype, t.bytes]),
) as Record<IdxDtype, number>;

/** Whether `bytes` starts with the gzip magic number 1f 8b. */
export function isGzip(bytes: Uint8Array): boolean {
  return bytes.length >= 2 && bytes[0] === 0x1f && bytes[1] === 0x8b;
}

/**
 * Parse the bytes of an (uncompressed) IDX file.
 * @param source the file name, used in error messages.
 * @returns the values; for uint8 and int8 files `data` is a view into `bytes` (no copy).
 * @throws LayerwiseError naming `source` if the magic number is wrong, the header or data is
 *   truncated, or there are bytes after the data.
 */
export function parseIdx(bytes: Uint8Array, source = '<IDX bytes>'): IdxArray {
  const fix =
    "give an IDX file such as MNIST's train-images-idx3-ubyte(.gz), re-downloading it if it is damaged";
  check(
    bytes.length >= 4,
    () =>
      `IDX file ${source} is truncated: ${bytes.length} bytes, shorter than the 4-byte header; ${fix}.`,
  );
  const type = TYPES[bytes[2]];
  check(
    bytes[0] === 0 && bytes[1] === 0 && type !== undefined && bytes[3] > 0,
    () =>
      `IDX file ${source} has bad magic number 0x${Array.from(bytes.subarray(0, 4), (b) => b.toString(16).padStart(2, '0')).join('')} (expected 0x0000TTNN, TT a type byte 08/09/0b/0c/0d/0e and NN the number of dimensions >= 1); it is not an IDX file: ${fix}.`,
  );
  const ndims = bytes[3];
  const headerLen = 4 + 4 * ndims;
  check(
    bytes.length >= headerLen,
    () =>
      `IDX file ${source} is truncated: ${bytes.length} bytes, shorter than its ${headerLen}-byte header for ${ndims} dimensions; ${fix}.`,
  );
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const dims: number[] = [];
  for (let i = 0; i < ndims; i++) dims.push(view.getUint32(4 + 4 * i, false));
  const count = dims.reduce((a, b) => a * b, 1);
  const expected = headerLen + count * type.bytes;
  check(
    bytes.length >= expected,
    () =>
      `IDX file ${source} is truncated: header says ${type.dtype} [${dims.join(', ')}] = ${expected} bytes, but the file has ${bytes.length}; ${fix}.`,
  );
  check(
    bytes.length === expected,
    () =>
      `IDX file ${source} has a size mismatch: header says ${type.dtype} [${dims.join(', ')}] = ${expected} bytes, but the file has ${bytes.length} (${bytes.length - expected} extra bytes); ${fix}.`,
  );
  const off = bytes.byteOffset + headerLen;
  let data: IdxData;
  switch (type.dtype) {
    case 'uint8':
      data = new Uint8Array(bytes.buffer, off, count);
      break;
    case 'int8':
      data = new Int8Array(bytes.buffer, off, count);
      break;
    case 'int16': {
      const a = new Int16Array(count);
      for (let i = 0; i < count; i++)
        a[i] = view.getInt16(headerLen + 2 * i, false);
      data = a;
      break;
    }
    case 'int32': {
      const a = new Int32Array(count);
      for (let i = 0; i < count; i++)
        a[i] = view.getInt32(headerLen + 4 * i, false);
      data = a;
      break;
    }
    case 'float32': {
      const a = new Float32Array(count);
      for (let i = 0; i < count; i++)
        a[i] = view.getFloat32(headerLen + 4 * i, false);
      data = a;
      break;
    }
    case 'float64': {
      const a = new Float64Array(count);
      for (let i = 0; i < count; i++)
        a[i] = view.getFloat64(headerLen + 8 * i, false);
      data = a;
      break;
    }
  }
  return { dtype: type.dtype, dims, data };
}

/**
 * Serialise an array as IDX bytes (uncompressed); the inverse of {@link parseIdx}. Used to
 * write test fixtures and converted data sets.
 * @throws LayerwiseError if `data.length` is not the product of `dims` or `dims` is empty.
 */
export function encodeIdx(
  dtype: IdxDtype,
  dims: number[],
  data: ArrayLike<number>,
): Uint8Array {
  check(
    dims.length >= 1 && dims.length <= 255,
    `IDX arrays need 1 to 255 dimensions, got ${dims.length}.`,
  );
  const count = dims.reduce((a, b) => a * b, 1);
  check(
    data.length === count,
    `IDX data has ${data.length} values but dims [${dims.join(', ')}] need ${count}.`,
  );
  const code = Number(
    Object.keys(TYPES).find((k) => TYPES[Number(k)].dtype === dtype),
  );
  const size = TYPE_BYTES[dtype];
  const headerLen = 4 + 4 * dims.length;
  const out = new Uint8Array(headerLen + count * size);
  const view = new DataView(out.buffer);
  out[2] = code;
  out[3] = dims.length;
  dims.forEach((d, i) => view.setUint32(4 + 4 * i, d, false));
  for (let i = 0; i < count; i++) {
    const p = headerLen + i * size;
    const v = data[i];
    switch (dtype) {
      case 'uint8':
        view.setUint8(p, v);
        break;
      case 'int8':
        view.setInt8(p, v);
        break;
      case 'int16':
        view.setInt16(p, v, false);
        break;
      case 'int32':
        view.setInt32(p, v, false);
        break;
      case 'float32':
        view.setFloat32(p, v, false);
        break;
      case 'float64':
        view.setFloat64(p, v, false);
        break;
    }
  }
  return out;
}

/**
 * Read and parse an IDX file, gunzipping it first if it is gzip-compressed. If `path` does not
 * exist but `path + '.gz'` does, that is read instead.
 * @throws LayerwiseError naming the file if it is missing or unreadable, is corrupt gzip, or is
 *   not a well-formed IDX file (see {@link parseIdx}).
 */
export async function readIdxFile(path: string): Promise<IdxArray> {
  let bytes: Uint8Array;
  let used = path;
  try {
    bytes = await readFile(path);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ENOENT' && !path.endsWith('.gz')) {
      try {
        bytes = await readFile(`${path}.gz`);
        used = `${path}.gz`;
      } catch {
        throw new LayerwiseError(
          `IDX file ${path} does not exist (nor ${path}.gz); check the path (relative paths are resolved from ${process.cwd()}).`,
        );
      }
    } else if (code === 'ENOENT') {
      throw new LayerwiseError(
        `IDX file ${path} does not exist; check the path (relative paths are resolved from ${process.cwd()}).`,
      );
    } else if (code === 'EISDIR') {
      throw new LayerwiseError(
        `IDX path ${path} is a directory; give the path of an IDX file inside it.`,
      );
    } else {
      throw new LayerwiseError(
        `Cannot read IDX file ${path}: ${(e as Error).message}; check that it is readable.`,
      );
    }
  }
  if (isGzip(bytes)) {
    try {
      bytes = gunzipSync(bytes);
    } catch (e) {
      throw new LayerwiseError(
        `IDX file ${used} looks gzip-compressed but cannot be decompressed (${(e as Error).message}); it is damaged: download it again.`,
      );
    }
  }
  return parseIdx(bytes, used);
}
