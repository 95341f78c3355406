/** `node:fs/promises` for the browser bundle: the page has no files (see unavailable.ts). */
import { unavailable } from './unavailable.js';

const m = 'node:fs/promises';
export const readFile = unavailable(m, 'readFile');
export const writeFile = unavailable(m, 'writeFile');
export const appendFile = unavailable(m, 'appendFile');
export const stat = unavailable(m, 'stat');
export const access = unavailable(m, 'access');
export const mkdir = unavailable(m, 'mkdir');
export const rename = unavailable(m, 'rename');
export const rm = unavailable(m, 'rm');
export const readdir = unavailable(m, 'readdir');
export const open = unavailable(m, 'open');
export default {
  readFile,
  writeFile,
  appendFile,
  stat,
  access,
  mkdir,
  rename,
  rm,
  readdir,
  open,
};
