/**
 * The Node-only modules the library imports for processes, gRPC devices and their tokens
 * (`node:child_process`, `node:crypto`, `node:readline`, `node:url`, `node:v8`, `node:zlib`,
 * `@grpc/grpc-js`, `proper-lockfile`): in the browser bundle each name throws when used.
 */
import { unavailable } from './unavailable.js';

const m = 'a Node module';
export const spawn = unavailable(m, 'spawn (child_process)');
export const spawnSync = unavailable(m, 'spawnSync (child_process)');
export const execFileSync = unavailable(m, 'execFileSync (child_process)');
export type ChildProcess = never;
export const randomBytes = unavailable(m, 'randomBytes (crypto)');
export const createHash = unavailable(m, 'createHash (crypto)');
export const timingSafeEqual = unavailable(m, 'timingSafeEqual (crypto)');
export const createInterface = unavailable(m, 'createInterface (readline)');
export const fileURLToPath = unavailable(m, 'fileURLToPath (url)');
export const pathToFileURL = unavailable(m, 'pathToFileURL (url)');
export const serialize = unavailable(m, 'serialize (v8)');
export const deserialize = unavailable(m, 'deserialize (v8)');
export const gunzipSync = unavailable(m, 'gunzipSync (zlib)');
export const gzipSync = unavailable(m, 'gzipSync (zlib)');
export const lock = unavailable(m, 'lock (proper-lockfile)');
export default { lock };
export const credentials = {
  createSsl: unavailable(m, 'credentials (@grpc/grpc-js)'),
  createInsecure: unavailable(m, 'credentials (@grpc/grpc-js)'),
};
export const ServerCredentials = credentials;
export const makeGenericClientConstructor = unavailable(
  m,
  'makeGenericClientConstructor (@grpc/grpc-js)',
);
export const Metadata = unavailable(m, 'Metadata (@grpc/grpc-js)');
export const Server = unavailable(m, 'Server (@grpc/grpc-js)');
