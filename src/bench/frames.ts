/** Length-prefixed frames on a TCP socket, for the transport benchmark's raw-TCP floor. */

/**
 * Calls `f` with each whole frame (u32 length, u8 flag, payload) arriving on `sock`: chunks are
 * kept in a list and joined once per frame (joining at every chunk copies a 4 MiB frame ~60 times).
 */
export function onFrames(
  sock: NodeJS.ReadableStream,
  f: (frame: Buffer) => void,
): void {
  let chunks: Buffer[] = [];
  let have = 0;
  sock.on('data', (d: Buffer) => {
    chunks.push(d);
    have += d.length;
    for (;;) {
      if (have < 5) return;
      const head = chunks[0]!.length >= 5 ? chunks[0]! : Buffer.concat(chunks);
      const need = 5 + head.readUInt32LE(0);
      if (have < need) return;
      const all =
        chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, have);
      f(all.subarray(0, need));
      const rest = all.subarray(need);
      chunks = rest.length ? [rest] : [];
      have = rest.length;
    }
  });
}
