/**
 * The far end of `npm run bench -- transport`, in its own process or thread: echoes what it is
 * sent, over a worker thread's port (`thread`), a gRPC link (`grpc`, the devices' transport:
 * runtime/grpc-link.ts) or a raw TCP socket (`tcp`, length-prefixed frames). Messages with
 * `echo: false` get a small ack instead of their payload back. Prints `listening on ADDRESS`
 * for grpc and tcp.
 */
import { createServer } from 'node:net';
import { parentPort } from 'node:worker_threads';
import * as grpc from '@grpc/grpc-js';
import {
  DEVICE_SERVICE,
  LINK_OPTIONS,
  StreamPort,
} from '../runtime/grpc-link.js';
import { onFrames } from './frames.js';

interface Msg {
  echo: boolean;
  data: unknown;
}
const answer = (m: Msg) => (m.echo ? m : { echo: false, data: 0 });

const mode = parentPort ? 'thread' : process.argv[2];
process.once('SIGINT', () => process.exit(0)); // exit handlers run (a --cpu-prof profile is written)
if (mode === 'thread') {
  parentPort!.on('message', (m: Msg) => parentPort!.postMessage(answer(m)));
} else if (mode === 'grpc') {
  const server = new grpc.Server(LINK_OPTIONS);
  server.addService(DEVICE_SERVICE, {
    link(call: grpc.ServerDuplexStream<Buffer, Buffer>) {
      const port = new StreamPort(call);
      port.on('message', (m) => port.postMessage(answer(m as Msg)));
    },
  });
  server.bindAsync(
    '127.0.0.1:0',
    grpc.ServerCredentials.createInsecure(),
    (e, p) => {
      if (e) throw e;
      console.log(`listening on 127.0.0.1:${p}`);
    },
  );
} else if (mode === 'tcp') {
  // frames: u32 length, u8 echo flag, payload; the answer is the frame itself or a 5-byte ack
  const server = createServer((sock) => {
    sock.setNoDelay(true);
    onFrames(sock, (frame) =>
      sock.write(frame[4] ? frame : Buffer.from([0, 0, 0, 0, 0])),
    );
  });
  server.listen(0, '127.0.0.1', () =>
    console.log(
      `listening on 127.0.0.1:${(server.address() as { port: number }).port}`,
    ),
  );
} else {
  console.error('usage: transport-echo.js grpc|tcp (or as a worker thread)');
  process.exit(2);
}
