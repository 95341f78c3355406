/**
 * What both ends of a browser device's WebSocket agree on (runtime/browser-device.ts in Node,
 * web/device.ts in the tab): the first byte of every message says which link it belongs to.
 */
export const LINK_TAG = { control: 0, prev: 1, next: 2 } as const;
