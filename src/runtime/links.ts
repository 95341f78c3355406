/**
 * Links between neighbour stages, whatever their devices are: a strategy asks for the links of
 * its devices and hands each stage its `prev` and `next` in `init`, without knowing the
 * transport. Two worker threads share a MessageChannel; two device servers (processes, hosts)
 * link directly over gRPC, the previous dialling the next; a worker thread next to a device
 * server gets a MessagePort that this process bridges to a gRPC link it opens to the server in
 * the thread's place (a thread has no server of its own to accept a link).
 */
import { MessageChannel, MessagePort } from 'node:worker_threads';
import type { Device } from './device.js';
import type { RemoteLink } from './protocol.js';
import { RemoteDevice } from './remote-device.js';

/** One stage's side of a link: a MessagePort (a thread), or a gRPC link to open or accept (a device server). */
export type StageLink = MessagePort | RemoteLink;

/** What stage i's `init` gets about its neighbours. */
export interface StageNeighbours {
  /** Link to the previous stage (absent on the first stage). */
  prev?: StageLink;
  /** Link to the next stage (absent on the last stage). */
  next?: StageLink;
  /** The MessagePorts among `prev` and `next`: `init` must transfer them to the device. */
  transfer: MessagePort[];
}

/**
 * The link between `a` and the next device `b` (the next stage's, or with `replica` the next
 * replica's in a ring): a's `next` and b's `prev`.
 */
function link(a: Device, b: Device, replica: boolean): [StageLink, StageLink] {
  if (a instanceof RemoteDevice && b instanceof RemoteDevice)
    return [{ connect: b.address }, { accept: true }];
  if (b instanceof RemoteDevice)
    return [b.bridgedLink(replica ? 'replica-prev' : 'prev'), { accept: true }];
  if (a instanceof RemoteDevice)
    return [{ accept: true }, a.bridgedLink(replica ? 'replica-next' : 'next')];
  const { port1, port2 } = new MessageChannel();
  return [port1, port2];
}

/**
 * The neighbour links of a pipeline of devices, one entry per device in order; with `wrap`
 * (interleaved schedules on more than 2 devices: the last device sends to the first), the last
 * device's `next` and the first's `prev` are one more link between them, closing the ring.
 * Links to a device server that this process opens on a thread's behalf close when that device
 * is terminated. With `replica`, the links are a ring of one stage's data-parallel replicas
 * (StageInit's `replicaPrev` / `replicaNext`; pass `wrap` for more than two).
 */
export function linkNeighbours(
  devices: readonly Device[],
  wrap = false,
  replica = false,
): StageNeighbours[] {
  const out: StageNeighbours[] = devices.map(() => ({ transfer: [] }));
  const join = (i: number, j: number) => {
    const [next, prev] = link(devices[i]!, devices[j]!, replica);
    out[i]!.next = next;
    out[j]!.prev = prev;
    if (next instanceof MessagePort) out[i]!.transfer.push(next);
    if (prev instanceof MessagePort) out[j]!.transfer.push(prev);
  };
  for (let i = 0; i + 1 < devices.length; i++) join(i, i + 1);
  if (wrap && devices.length > 2) join(devices.length - 1, 0);
  return out;
}

/**
 * The links of R data-parallel replicas of a pipeline of K devices (`devices[r * K + d]`:
 * replica r's device d): each replica's neighbour links, and for each d the ring of its R
 * replicas (one link for R = 2), unless `ring` is false (the replicas meet elsewhere: L2L's
 * parameter server sums what they push). One entry per device.
 */
export function linkReplicas(
  devices: readonly Device[],
  k: number,
  wrap = false,
  ring = true,
): Array<
  StageNeighbours & {
    replicaPrev?: StageLink;
    replicaNext?: StageLink;
  }
> {
  const r = devices.length / k;
  const out = devices.map(
    () =>
      ({ transfer: [] as MessagePort[] }) as StageNeighbours & {
        replicaPrev?: StageLink;
        replicaNext?: StageLink;
      },
  );
  for (let i = 0; i < r; i++)
    linkNeighbours(devices.slice(i * k, (i + 1) * k), wrap).forEach((n, d) => {
      const o = out[i * k + d]!;
      o.prev = n.prev;
      o.next = n.next;
      o.transfer.push(...n.transfer);
    });
  if (r > 1 && ring)
    for (let d = 0; d < k; d++) {
      const group = Array.from({ length: r }, (_, i) => devices[i * k + d]!);
      linkNeighbours(group, true, true).forEach((n, i) => {
        const o = out[i * k + d]!;
        o.replicaPrev = n.prev;
        o.replicaNext = n.next;
        o.transfer.push(...n.transfer);
      });
    }
  return out;
}
