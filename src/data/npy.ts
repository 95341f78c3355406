/**
 * Reader for NumPy `.npy` files (format versions 1.0, 2.0 and 3.0,
 * https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html): the magic string
 * `\x93NUMPY`, a major and a minor version byte, the header length (little-endian uint16 in
 * version 1, uint32 in versions 2 and 3), then the header, a Python dict literal such as
 * `{'descr': '<f4', 'fortran_order': False, 'shape': (60000, 784), }` padded with spaces and
 * ended by a newline, then the values in C (row-major) order.
 *
 * Strict on purpose: only little-endian (or single-byte) numeric dtypes in C order are read;
 * big-endian data, Fortran order, structured, string and object (pickled) arrays are rejected
 * with a message saying how to convert the file in NumPy.
 */
import { readFile, stat } from 'node:fs/promises';
import { check, LayerwiseError } from '../util/errors.js';

/** Element types read from `.npy` files, by NumPy name. */
export type NpyDtype =
  | 'bool'
  | 'uint8'
  | 'int8'
  | 'uint16'
  | 'int16'
  | 'uint32'
  | 'int32'
  | 'uint64'
  | 'int64'
  | 'float32'
  | 'float64';

/** Typed array holding the values of a `.npy` file. */
export type NpyData =
  | Uint8Array
  | Int8Array
  | Uint16Array
  | Int16Array
  | Uint32Array
  | Int32Array
  | BigUint64Array
  | BigInt64Array
  | Float32Array
  | Float64Array;

/** A parsed `.npy` file. */
export interface NpyArray {
  dtype: NpyDtype;
  /** The header's `shape`, outermost first; [] for a 0-d array. */
  shape: number[];
  /** The values in row-major order (length = product of shape), in native byte order (a copy). */
  data: NpyData;
}

/** Type code (descr without its byte-order character) -> dtype, bytes per value and array constructor. */
const CODES: Record<
  string,
  {
    dtype: NpyDtype;
    bytes: number;
    make: (buf: ArrayBuffer, n: number) => NpyData;
  }
> = {
  b1: { dtype: 'bool', bytes: 1, make: (b, n) => new Uint8Array(b, 0, n) },
  u1: { dtype: 'uint8', bytes: 1, make: (b, n) => new Uint8Array(b, 0, n) },
  i1: { dtype: 'int8', bytes: 1, make: (b, n) => new Int8Array(b, 0, n) },
  u2: { dtype: 'uint16', bytes: 2, make: (b, n) => new Uint16Array(b, 0, n) },
  i2: { dtype: 'int16', bytes: 2, make: (b, n) => new Int16Array(b, 0, n) },
  u4: { dtype: 'uint32', bytes: 4, make: (b, n) => new Uint32Array(b, 0, n) },
  i4: { dtype: 'int32', bytes: 4, make: (b, n) => new Int32Array(b, 0, n) },
  u8: {
    dtype: 'uint64',
    bytes: 8,
    make: (b, n) => new BigUint64Array(b, 0, n),
  },
  i8: { dtype: 'int64', bytes: 8, make: (b, n) => new BigInt64Array(b, 0, n) },
  f4: { dtype: 'float32', bytes: 4, make: (b, n) => new Float32Array(b, 0, n) },
  f8: { dtype: 'float64', bytes: 8, make: (b, n) => new Float64Array(b, 0, n) },
};

const SUPPORTED =
  "'<f4', '<f8', '|u1', '|i1', '<i2', '<u2', '<i4', '<u4', '<i8', '<u8', '|b1'";

/** Whether this machine stores numbers little-endian (every platform Node supports in practice). */
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** A value of the header's Python literal. */
type PyValue =
  | string
  | number
  | boolean
  | null
  | PyValue[]
  | { tuple: PyValue[] }
  | Map<string, PyValue>;

/**
 * Parse the Python literal of a `.npy` header: a dict of string keys whose values are strings,
 * True/False/None, integers, tuples or lists. Throws a plain Error with a short reason.
 */
function parsePyLiteral(src: string): PyValue {
  let i = 0;
  const ws = () => {
    while (i < src.length && /\s/.test(src[i])) i++;
  };
  const fail = (what: string): never => {
    throw new Error(`${what} at character ${i}`);
  };
  const value = (): PyValue => {
    ws();
    const c = src[i];
    if (c === '{') {
      i++;
      const m = new Map<string, PyValue>();
      for (;;) {
        ws();
        if (src[i] === '}') {
          i++;
          return m;
        }
        const k = value();
        if (typeof k !== 'string') fail('a dict key that is not a string');
        ws();
        if (src[i] !== ':') fail("expected ':'");
        i++;
        if (m.has(k as string)) fail(`duplicate key '${k as string}'`);
        m.set(k as string, value());
        ws();
        if (src[i] === ',') i++;
        else if (src[i] !== '}') fail("expected ',' or '}'");
      }
    }
    if (c === '(' || c === '[') {
      const close = c === '(' ? ')' : ']';
      i++;
      const items: PyValue[] = [];
      let commas = 0;
      for (;;) {
        ws();
        if (src[i] === close) {
          i++;
          // (5) is the number 5 in Python, (5,) a tuple
          if (c === '(' && items.length === 1 && commas === 0) return items[0];
          return c === '(' ? { tuple: items } : items;
        }
        items.push(value());
        ws();
        if (src[i] === ',') {
          i++;
          commas++;
        } else if (src[i] !== close) fail(`expected ',' or '${close}'`);
      }
    }
    if (c === "'" || c === '"') {
      const end = src.indexOf(c, i + 1);
      if (end < 0) fail('an unterminated string');
      const s = src.slice(i + 1, end);
      if (s.includes('\\')) fail('an escape in a string');
      i = end + 1;
      return s;
    }
    const m = /^(True|False|None|-?\d+L?)/.exec(src.slice(i));
    if (!m)
      fail(
        i >= src.length
          ? 'unexpected end'
          : `unexpected ${JSON.stringify(src[i])}`,
      );
    i += m![0].length;
    const t = m![0];
    if (t === 'True') return true;
    if (t === 'False') return false;
    if (t === 'None') return null;
    return Number(t.replace(/L$/, '')); // Python 2 wrote long integers as 3L
  };
  const v = value();
  ws();
  if (i !== src.length) fail('unexpected text after the dict');
  return v;
}

/** A shape as NumPy prints it: `(3,)`, `(2, 4)`, `()`. */
export function pyShape(shape: number[]): string {
  return `(${shape.join(', ')}${shape.length === 1 ? ',' : ''})`;
}

/** A header value written back as Python would, for messages: `[('a', '<f4')]`, `(2, -1)`. */
function pyRepr(v: PyValue | undefined): string {
  if (v === undefined) return 'missing';
  if (v === null) return 'None';
  if (typeof v === 'boolean') return v ? 'True' : 'False';
  if (typeof v === 'number') return String(v);
  if (typeof v === 'string') return `'${v}'`;
  if (Array.isArray(v)) return `[${v.map(pyRepr).join(', ')}]`;
  if (v instanceof Map)
    return `{${[...v].map(([k, x]) => `'${k}': ${pyRepr(x)}`).join(', ')}}`;
  return `(${v.tuple.map(pyRepr).join(', ')}${v.tuple.length === 1 ? ',' : ''})`;
}

/** The advice that ends most of parseNpy's messages. */
const FIX = 'give a file written by numpy.save()';

/**
 * Reads the preamble of a `.npy` file's bytes: the magic string, the version and the header
 * length. Returns the major version, where the header starts and its length in bytes. Throws
 * {@link LayerwiseError} naming `source` for a missing magic string, an unknown version or
 * bytes that end before the header does.
 */
function readPreamble(
  bytes: Uint8Array,
  source: string,
): { major: number; start: number; headerLen: number } {
  const magic = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]; // \x93NUMPY
  check(
    bytes.length >= 6 && magic.every((b, k) => bytes[k] === b),
    () =>
      `.npy file ${source} does not start with the magic string \\x93NUMPY (it starts with ${JSON.stringify(String.fromCharCode(...bytes.subarray(0, 6)))}); it is not a .npy file: ${FIX} (an .npz archive must be unzipped first).`,
  );
  check(
    bytes.length >= 10,
    () =>
      `.npy file ${source} is truncated: ${bytes.length} bytes, shorter than its preamble; ${FIX}, re-writing it if it is damaged.`,
  );
  const major = bytes[6];
  check(
    major === 1 || major === 2 || major === 3,
    () =>
      `.npy file ${source} has format version ${major}.${bytes[7]}; versions 1.0, 2.0 and 3.0 are supported: ${FIX}.`,
  );
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const lenBytes = major === 1 ? 2 : 4;
  check(
    bytes.length >= 8 + lenBytes,
    () =>
      `.npy file ${source} is truncated inside its header length; ${FIX}, re-writing it if it is damaged.`,
  );
  const headerLen =
    major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = 8 + lenBytes;
  check(
    bytes.length >= start + headerLen,
    () =>
      `.npy file ${source} is truncated: its header says ${headerLen} bytes but only ${bytes.length - start} follow; ${FIX}, re-writing it if it is damaged.`,
  );
  return { major, start, headerLen };
}

/**
 * The header dict of a `.npy` file (`header`: its text), holding exactly 'descr',
 * 'fortran_order' and 'shape'. Throws {@link LayerwiseError} naming `source` for a header that
 * does not parse, is not a dict, or lacks or adds a field.
 */
function readHeaderDict(header: string, source: string): Map<string, PyValue> {
  let dict: PyValue;
  try {
    dict = parsePyLiteral(header);
  } catch (e) {
    throw new LayerwiseError(
      `.npy file ${source} has a malformed header ${JSON.stringify(header.trim())}: ${(e as Error).message}; ${FIX}.`,
    );
  }
  check(
    dict instanceof Map,
    () =>
      `.npy file ${source} has a header ${JSON.stringify(header.trim())} that is not a dict; ${FIX}.`,
  );
  const d = dict as Map<string, PyValue>;
  for (const key of ['descr', 'fortran_order', 'shape']) {
    check(
      d.has(key),
      () =>
        `.npy file ${source} has no '${key}' in its header ${JSON.stringify(header.trim())}; ${FIX}.`,
    );
  }
  const extra = [...d.keys()].filter(
    (k) => k !== 'descr' && k !== 'fortran_order' && k !== 'shape',
  );
  check(
    extra.length === 0,
    () =>
      `.npy file ${source} has unexpected header field(s) ${extra.map((k) => `'${k}'`).join(', ')} (only 'descr', 'fortran_order' and 'shape' are allowed); ${FIX}.`,
  );
  return d;
}

/**
 * The element type the header's 'descr' names ({@link CODES}). Throws {@link LayerwiseError}
 * naming `source` for a structured or unsupported dtype, big-endian data, or a multi-byte type
 * without a byte order (or in native order on a big-endian machine).
 */
function readDescr(
  d: Map<string, PyValue>,
  source: string,
): (typeof CODES)[string] {
  const descr = d.get('descr');
  check(
    typeof descr === 'string',
    () =>
      `.npy file ${source} has a structured dtype (header field 'descr' is ${pyRepr(descr)}); only plain numeric arrays are supported: save one array per file, e.g. np.save('x.npy', arr['field'].astype('<f4')).`,
  );
  const order = descr[0];
  const code = CODES[descr.slice(1)];
  check(
    code !== undefined &&
      (order === '<' || order === '>' || order === '|' || order === '='),
    () =>
      `.npy file ${source} has unsupported dtype (header field 'descr' is '${descr}'); supported are ${SUPPORTED}: convert it, e.g. np.save(path, arr.astype('<f4')).`,
  );
  check(
    order !== '>' || code.bytes === 1,
    () =>
      `.npy file ${source} is big-endian (header field 'descr' is '${descr}'); only little-endian data is supported: convert it with np.save(path, arr.astype('<${descr.slice(1)}')).`,
  );
  check(
    order !== '|' || code.bytes === 1,
    () =>
      `.npy file ${source} has a multi-byte dtype without a byte order (header field 'descr' is '${descr}'); ${FIX}.`,
  );
  check(
    order !== '=' || code.bytes === 1 || LITTLE_ENDIAN,
    () =>
      `.npy file ${source} has native byte order ('=' in header field 'descr') on a big-endian machine; save it as little-endian ('<${descr.slice(1)}').`,
  );
  return code;
}

/**
 * The header's 'shape', after checking that 'fortran_order' is False. Throws
 * {@link LayerwiseError} naming `source` for Fortran order, a 'fortran_order' that is not a
 * boolean, or a shape that is not a tuple of non-negative integers.
 */
function readShape(d: Map<string, PyValue>, source: string): number[] {
  const fortran = d.get('fortran_order');
  check(
    typeof fortran === 'boolean',
    () =>
      `.npy file ${source} has header field 'fortran_order' = ${pyRepr(fortran)}, not True or False; ${FIX}.`,
  );
  check(
    fortran === false,
    () =>
      `.npy file ${source} is in Fortran (column-major) order (header field 'fortran_order' is True); save it in C order: np.save(path, np.ascontiguousarray(arr)).`,
  );
  const shapeV = d.get('shape');
  const shapeItems =
    shapeV !== null && typeof shapeV === 'object' && 'tuple' in shapeV
      ? shapeV.tuple
      : undefined;
  check(
    shapeItems?.every(
      (s) => typeof s === 'number' && Number.isSafeInteger(s) && s >= 0,
    ),
    () =>
      `.npy file ${source} has header field 'shape' = ${pyRepr(shapeV)}, not a tuple of non-negative integers; ${FIX}.`,
  );
  return shapeItems as number[];
}

/**
 * The values of a `.npy` file, which start at byte `off` of `bytes`: `shape`'s count of `code`'s
 * type, copied into a fresh, aligned buffer in native byte order. Throws {@link LayerwiseError}
 * naming `source` when the bytes end before the values do or go on after them.
 */
function readValues(
  bytes: Uint8Array,
  source: string,
  off: number,
  shape: number[],
  code: (typeof CODES)[string],
): NpyData {
  const count = shape.reduce((a, b) => a * b, 1);
  const expected = off + count * code.bytes;
  check(
    Number.isSafeInteger(expected) && bytes.length >= expected,
    () =>
      `.npy file ${source} is truncated: header says ${code.dtype} ${pyShape(shape)} = ${count * code.bytes} data bytes, but the file has ${bytes.length - off}; ${FIX}, re-writing it if it is damaged.`,
  );
  check(
    bytes.length === expected,
    () =>
      `.npy file ${source} has ${bytes.length - expected} extra bytes after the ${code.dtype} ${pyShape(shape)} data its header describes; ${FIX} (one array per file).`,
  );
  // Copy into a fresh, aligned buffer (the data may start at any offset of the file's bytes).
  const buf = new ArrayBuffer(count * code.bytes);
  const out = new Uint8Array(buf);
  out.set(bytes.subarray(off, off + count * code.bytes));
  if (!LITTLE_ENDIAN && code.bytes > 1) {
    for (let k = 0; k < out.length; k += code.bytes)
      out.subarray(k, k + code.bytes).reverse();
  }
  return code.make(buf, count);
}

/**
 * Parse the bytes of a `.npy` file.
 * @param source the file name, used in error messages.
 * @returns dtype, shape and a copy of the values in native byte order.
 * @throws LayerwiseError naming `source` and the offending header field if the magic string,
 *   version or header is malformed, the dtype is unsupported (big-endian, structured, string,
 *   object, float16, complex), the array is in Fortran order, or the data is truncated or
 *   followed by extra bytes.
 */
export function parseNpy(bytes: Uint8Array, source = '<.npy bytes>'): NpyArray {
  const { major, start, headerLen } = readPreamble(bytes, source);
  const header = new TextDecoder(major === 3 ? 'utf-8' : 'latin1').decode(
    bytes.subarray(start, start + headerLen),
  );
  const d = readHeaderDict(header, source);
  const code = readDescr(d, source);
  const shape = readShape(d, source);
  return {
    dtype: code.dtype,
    shape,
    data: readValues(bytes, source, start + headerLen, shape, code),
  };
}

/**
 * Read and parse a `.npy` file.
 * @throws LayerwiseError if the file is missing, unreadable or malformed (see {@link parseNpy}).
 */
export async function readNpyFile(path: string): Promise<NpyArray> {
  let bytes: Buffer;
  try {
    const st = await stat(path);
    check(
      st.isFile(),
      `.npy path ${path} is not a regular file; give the path of a file written by numpy.save().`,
    );
    bytes = await readFile(path);
  } catch (e) {
    if (e instanceof LayerwiseError) throw e;
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ENOENT')
      throw new LayerwiseError(
        `.npy file ${path} does not exist; check the path (relative paths are resolved from ${process.cwd()}).`,
      );
    throw new LayerwiseError(
      `Cannot read .npy file ${path}: ${(e as Error).message}; check that it exists and is readable.`,
    );
  }
  return parseNpy(bytes, path);
}
