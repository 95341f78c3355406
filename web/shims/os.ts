/** `node:os` for the browser bundle. */

/** The browser's logical processor count. */
export function availableParallelism(): number {
  return globalThis.navigator?.hardwareConcurrency || 1;
}

export function hostname(): string {
  return globalThis.location?.hostname || 'browser';
}

export function cpus(): unknown[] {
  return new Array(availableParallelism()).fill({});
}

export default { availableParallelism, hostname, cpus };
