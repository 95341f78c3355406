/**
 * What the browser bundle puts where the library imports a Node-only module it does not use
 * in the browser (files, processes, gRPC, the native addon): functions that throw, naming the
 * module, if a code path that needs it is ever reached.
 */

/** A function that throws "`<module>.<name>` is not available in the browser". */
export function unavailable(module: string, name: string) {
  return (..._args: unknown[]): never => {
    throw new Error(
      `${module}: ${name} is not available in the browser (files, processes, gRPC and the native addon are Node only)`,
    );
  };
}
