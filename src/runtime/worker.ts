/**
 * Entry point of a device that is a worker thread: its stage host (runtime/stage-host.ts) serves
 * the main thread over the thread's parent port, and talks to its neighbour stages over the
 * MessagePorts the coordinator hands it. Its `workerData` ({@link WorkerData}) names the CPUs its
 * kernel team is bound to.
 */
import { MessagePort, parentPort, workerData } from 'node:worker_threads';
import { Channel, LinkLostError } from './channel.js';
import type { WorkerData } from './device.js';
import { serveStage } from './stage-host.js';

if (!parentPort)
  throw new Error('runtime/worker.js must run in a worker thread');
void serveStage(
  new Channel(parentPort),
  (link, side) => {
    if (!(link instanceof MessagePort))
      throw new Error(
        `a worker-thread device needs a MessagePort to its ${side} stage`,
      );
    const ch = new Channel(link);
    // in a device process, the I/O thread says when the gRPC link behind this port is lost
    link.on('message', (m: { type?: string; why?: string }) => {
      if (m?.type === 'link-lost')
        ch.fail(
          new LinkLostError(
            `the link to the ${side.endsWith('prev') ? 'previous' : 'next'} ${side.startsWith('replica') ? 'replica' : 'stage'} was lost: ${m.why}`,
          ),
        );
    });
    return ch;
  },
  { cpus: (workerData as WorkerData | undefined)?.cpus },
);
