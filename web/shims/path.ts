/** `node:path` for the browser bundle: POSIX paths of the page's virtual root `/`. */

/** The path's segments with `.` and `..` resolved. */
function normalizeSegments(parts: string[]): string[] {
  const out: string[] = [];
  for (const p of parts) {
    if (p === '' || p === '.') continue;
    if (p === '..') out.pop();
    else out.push(p);
  }
  return out;
}

export const sep = '/';

export function isAbsolute(p: string): boolean {
  return p.startsWith('/');
}

export function resolve(...paths: string[]): string {
  let all: string[] = [];
  for (const p of paths) all = isAbsolute(p) ? [p] : [...all, p];
  return `/${normalizeSegments(all.join('/').split('/')).join('/')}`;
}

export function join(...paths: string[]): string {
  const joined = paths.filter((p) => p !== '').join('/');
  const body = normalizeSegments(joined.split('/')).join('/');
  return isAbsolute(joined) ? `/${body}` : body || '.';
}

export function dirname(p: string): string {
  const i = p.replace(/\/+$/, '').lastIndexOf('/');
  if (i < 0) return '.';
  return i === 0 ? '/' : p.slice(0, i);
}

export function basename(p: string, ext?: string): string {
  const base = p.replace(/\/+$/, '').split('/').pop() ?? '';
  return ext && base.endsWith(ext) ? base.slice(0, -ext.length) : base;
}

export function extname(p: string): string {
  const base = basename(p);
  const i = base.lastIndexOf('.');
  return i > 0 ? base.slice(i) : '';
}

export function relative(from: string, to: string): string {
  const a = resolve(from).split('/').filter(Boolean);
  const b = resolve(to).split('/').filter(Boolean);
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return [...a.slice(i).map(() => '..'), ...b.slice(i)].join('/');
}

export default {
  sep,
  isAbsolute,
  resolve,
  join,
  dirname,
  basename,
  extname,
  relative,
};
