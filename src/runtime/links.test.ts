import assert from 'node:assert/strict';
import { test } from 'node:test';
import { MessagePort } from 'node:worker_threads';
import type { Device } from './device.js';
import { linkReplicas } from './links.js';

/** Thread-like devices (not device servers): their links are MessageChannels. */
const devices = (n: number): Device[] =>
  Array.from({ length: n }, (_, i) => ({ index: i }) as unknown as Device);

function closeAll(links: ReturnType<typeof linkReplicas>): void {
  for (const l of links) for (const p of l.transfer) p.close();
}

test('linkReplicas: 2 replicas of 2 devices get a replica ring unless ring is false (the replicas meet in a parameter server)', () => {
  const ringed = linkReplicas(devices(4), 2);
  try {
    // replica 0's device d and replica 1's device d are linked (one link for R = 2)
    for (const d of [0, 1]) {
      assert.ok(ringed[d]!.replicaNext instanceof MessagePort, `device ${d}`);
      assert.ok(ringed[2 + d]!.replicaPrev instanceof MessagePort);
    }
    assert.equal(ringed[0]!.transfer.length, 2, 'next and replicaNext');
  } finally {
    closeAll(ringed);
  }
  const apart = linkReplicas(devices(4), 2, false, false);
  try {
    for (const [g, l] of apart.entries()) {
      assert.equal(l.replicaPrev, undefined, `device ${g}`);
      assert.equal(l.replicaNext, undefined, `device ${g}`);
      // each replica's pipeline is still linked: device 0 -> 1, device 2 -> 3
      assert.equal(l.transfer.length, 1, `device ${g}: its one neighbour`);
    }
    assert.ok(apart[0]!.next instanceof MessagePort);
    assert.ok(apart[3]!.prev instanceof MessagePort);
    assert.equal(apart[1]!.next, undefined, 'no link across replicas');
  } finally {
    closeAll(apart);
  }
});
