/**
 * Entry point of a device process a coordinator spawns on its own host (`--devices
 * process,...`): a device server on a free loopback port for one run. It prints
 * `layerwise-device listening on HOST:PORT` as its first line, takes the run's token from
 * LAYERWISE_TOKEN, and exits when the coordinator's link ends, or when its parent process is
 * gone (no orphans even if the coordinator is killed).
 */
import { startDeviceServer } from './device-server.js';

const token = process.env.LAYERWISE_TOKEN;
if (!token) {
  console.error('layerwise device: LAYERWISE_TOKEN is not set');
  process.exit(2);
}
const server = await startDeviceServer({
  host: '127.0.0.1',
  port: 0,
  token,
  once: true,
});
process.stdout.write(`layerwise-device listening on ${server.address}\n`);
const parent = process.ppid;
// the coordinator may die without closing its link (SIGKILL): then so does this device
setInterval(() => {
  try {
    process.kill(parent, 0);
  } catch {
    process.exit(1);
  }
}, 1000).unref();
await server.done;
process.exit(0);
