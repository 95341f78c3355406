/** `node:fs` for the browser bundle: the page has no files (see unavailable.ts). */
import { unavailable } from './unavailable.js';

const m = 'node:fs';
export const existsSync = (_p: string): boolean => false;
export const statSync = unavailable(m, 'statSync');
export const accessSync = unavailable(m, 'accessSync');
export const readFileSync = unavailable(m, 'readFileSync');
export const openSync = unavailable(m, 'openSync');
export const readSync = unavailable(m, 'readSync');
export const writeFileSync = unavailable(m, 'writeFileSync');
export const utimesSync = unavailable(m, 'utimesSync');
export const readdirSync = unavailable(m, 'readdirSync');
export const rmSync = unavailable(m, 'rmSync');
export const constants = { W_OK: 2, X_OK: 1, R_OK: 4, F_OK: 0 };
export type Stats = { isFile(): boolean; isDirectory(): boolean };
export default { existsSync, statSync, readFileSync, constants };
