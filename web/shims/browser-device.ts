/**
 * runtime/browser-device.ts for the browser bundle: a page cannot serve other tabs, so a run in
 * the page has no `browser` devices (the coordinator of such a run is `layerwise train` in Node).
 */
export const BrowserHub = {
  start(): never {
    throw new Error(
      'a run in the page cannot use --devices browser: start it with layerwise train in Node',
    );
  },
};
