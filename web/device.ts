/**
 * This tab as one stage's device of a run in Node (`layerwise train --devices thread,browser`,
 * runtime/browser-device.ts): the page opened with `?device=1&token=...` connects back to the
 * server that served it over a WebSocket, starts the stage in a Web Worker (worker.js, the same
 * stage host a Node worker thread runs) and relays: the coordinator's control messages to the
 * worker and its replies back, and the worker's links to its neighbour stages (MessagePorts
 * here) over the same WebSocket, each message tagged with its link (runtime/wire-codec.ts
 * encodes them).
 */
import { LINK_TAG } from '../src/runtime/browser-link.js';
import { decodeMessage, encodeMessage } from '../src/runtime/wire-codec.js';

/** The ArrayBuffers of a decoded message's typed arrays (its own copies: they can move). */
function buffersOf(v: unknown, out = new Set<ArrayBuffer>()): ArrayBuffer[] {
  if (v !== null && typeof v === 'object') {
    if (ArrayBuffer.isView(v)) {
      if (v.buffer instanceof ArrayBuffer) out.add(v.buffer);
    } else if (v instanceof Map) {
      for (const x of v.values()) buffersOf(x, out);
    } else for (const x of Object.values(v)) buffersOf(x, out);
  }
  return [...out];
}

/** What the device mode tells the page: a line to show, and whether the run has ended. */
export type DeviceReport = (line: string, ended?: 'done' | 'error') => void;

/**
 * Serves as a device until the coordinator ends the run or the link is lost; `report` hears
 * what happens. Resolves when the run is over.
 */
export function serveAsDevice(
  token: string,
  report: DeviceReport,
): Promise<void> {
  const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
  const ws = new WebSocket(
    `${scheme}://${location.host}/device?token=${encodeURIComponent(token)}`,
  );
  ws.binaryType = 'arraybuffer';
  const worker = new Worker(new URL('./worker.js', import.meta.url), {
    type: 'module',
  });
  worker.postMessage({ layerwiseWorkerData: null }); // the shim's workerData (worker-threads.ts)
  const links = new Map<number, MessagePort>();
  const send = (tag: number, v: unknown) => {
    if (ws.readyState !== WebSocket.OPEN) return;
    const body = new Uint8Array(encodeMessage(v));
    const out = new Uint8Array(1 + body.length);
    out[0] = tag;
    out.set(body, 1);
    ws.send(out);
  };
  worker.addEventListener('message', (e) => send(LINK_TAG.control, e.data));
  worker.addEventListener('error', (e) => {
    report(`the stage's worker failed: ${e.message}`, 'error');
    ws.close(1011, `the stage's worker failed in the tab: ${e.message}`);
  });
  let stage: number | undefined;
  ws.addEventListener('open', () =>
    report('connected to the run: waiting for its stage'),
  );
  ws.addEventListener('message', (e) => {
    const bytes = new Uint8Array(e.data as ArrayBuffer);
    const m = decodeMessage(bytes.subarray(1)) as {
      type: string;
      method?: string;
      args?: Record<string, unknown>;
    };
    if (bytes[0] !== LINK_TAG.control) {
      links.get(bytes[0]!)?.postMessage(m, buffersOf(m));
      return;
    }
    const transfer: Transferable[] = buffersOf(m);
    if (m.type === 'request' && m.method === 'init' && m.args) {
      stage = m.args.index as number;
      for (const side of ['prev', 'next'] as const) {
        if (!m.args[side]) continue;
        const tag = LINK_TAG[side];
        const { port1, port2 } = new MessageChannel();
        port1.onmessage = (ev) => send(tag, ev.data);
        links.set(tag, port1);
        m.args[side] = port2;
        transfer.push(port2);
      }
      report(
        `this tab runs stage ${stage} of the run on ${String(m.args.backend)}: keep it open until the run ends`,
      );
    }
    worker.postMessage(m, transfer);
  });
  return new Promise((resolve) =>
    ws.addEventListener('close', (e) => {
      worker.terminate();
      for (const p of links.values()) p.close();
      const clean = e.code === 1000;
      report(
        clean
          ? `the run ended${stage === undefined ? '' : ` (this tab ran stage ${stage})`}`
          : `the link to the run was lost or refused (WebSocket ${e.code}${e.reason ? `: ${e.reason}` : ''})`,
        clean ? 'done' : 'error',
      );
      resolve();
    }),
  );
}
