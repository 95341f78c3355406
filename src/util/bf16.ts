/**
 * bfloat16 rounding in plain JavaScript, for threads and backends without the native addon (its
 * toBf16 is the vectorised form of the same rounding). No imports: the parameter server's
 * optimizer threads and the page use it.
 */

/**
 * dst[i] = src[i] rounded to bfloat16 (round to nearest, ties to even; NaN stays a quiet NaN):
 * the native addon's toBf16 in plain JavaScript. RangeError if
 * the lengths differ.
 */
export function toBf16(src: Float32Array, dst: Uint16Array): void {
  if (src.length !== dst.length)
    throw new RangeError(
      `toBf16: ${src.length} float32 values into ${dst.length} bf16 slots`,
    );
  const u = new Uint32Array(src.buffer, src.byteOffset, src.length);
  for (let i = 0; i < u.length; i++) {
    const x = u[i]!;
    if ((x & 0x7fffffff) > 0x7f800000) dst[i] = (x >>> 16) | 0x40;
    else dst[i] = (x + 0x7fff + ((x >>> 16) & 1)) >>> 16;
  }
}
