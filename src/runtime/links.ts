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

/** The link between `a` and the next stage's device `b`: a's `next` and b's `prev`. */
function link(a: Device, b: Device): [StageLink, StageLink] {
  if (a instanceof RemoteDevice && b instanceof RemoteDevice)
    return [{ connect: b.address }, { accept: true }];
  if (b instanceof RemoteDevice)
    return [b.bridgedLink('prev'), { accept: true }];
  if (a instanceof RemoteDevice)
    return [{ accept: true }, a.bridgedLink('next')];
  const { port1, port2 } = new MessageChannel();
  return [port1, port2];
}

/**
 * The neighbour links of a pipeline of devices, one entry per device in order; with `wrap`
 * (interleaved schedules on more than 2 devices: the last device sends to the first), the last
 * device's `next` and the first's `prev` are one more link between them, closing the ring.
 * Links to a device server that this process opens on a thread's behalf close when that device
 * is terminated.
 */
export function linkNeighbours(
  devices: readonly Device[],
  wrap = false,
): StageNeighbours[] {
  const out: StageNeighbours[] = devices.map(() => ({ transfer: [] }));
  const join = (i: number, j: number) => {
    const [next, prev] = link(devices[i]!, devices[j]!);
    out[i]!.next = next;
    out[j]!.prev = prev;
    if (next instanceof MessagePort) out[i]!.transfer.push(next);
    if (prev instanceof MessagePort) out[j]!.transfer.push(prev);
  };
  for (let i = 0; i + 1 < devices.length; i++) join(i, i + 1);
  if (wrap && devices.length > 2) join(devices.length - 1, 0);
  return out;
}
