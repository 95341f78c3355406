import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import {
  cpuSiblings,
  cpuTopology,
  describeTopology,
  parseCpuList,
} from './cpu.js';
import { LayerwiseError } from './errors.js';

test('parseCpuList reads ranges and single CPUs in order, and names a bad part', () => {
  assert.deepEqual(parseCpuList('0-3,8,10-11\n'), [0, 1, 2, 3, 8, 10, 11]);
  assert.deepEqual(parseCpuList('5'), [5]);
  assert.deepEqual(parseCpuList('2,0-1'), [0, 1, 2]);
  assert.throws(() => parseCpuList('3-1'), /'3-1' is not N or N-M/);
  assert.throws(() => parseCpuList('0-3,x'), LayerwiseError);
});

/** A fake sysfs cpu folder: cpuN -> its thread_siblings_list. */
function fakeSysfs(siblings: string[]): string {
  const root = mkdtempSync(join(tmpdir(), 'cpu-topology-'));
  siblings.forEach((list, i) => {
    const dir = join(root, `cpu${i}`, 'topology');
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'thread_siblings_list'), `${list}\n`);
  });
  mkdirSync(join(root, 'cpufreq')); // not a cpuN folder: ignored
  mkdirSync(join(root, `cpu${siblings.length}`)); // offline: no topology, not counted
  return root;
}

test('cpuTopology counts sibling groups as physical cores; cpuSiblings reads one CPU', () => {
  // 4 cores x 2 threads numbered as Linux often does: siblings c and c + 4
  const root = fakeSysfs([
    '0,4',
    '1,5',
    '2,6',
    '3,7',
    '0,4',
    '1,5',
    '2,6',
    '3,7',
  ]);
  try {
    assert.deepEqual(cpuTopology(root), {
      logical: 8,
      physicalCores: 4,
      threadsPerCore: 2,
    });
    assert.equal(
      describeTopology(cpuTopology(root)),
      '4 physical cores, 2 threads each',
    );
    assert.deepEqual(cpuSiblings(5, root), [1, 5]);
    assert.deepEqual(cpuSiblings(8, root), [8], 'no topology: itself alone');
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
  const flat = fakeSysfs(['0', '1']);
  try {
    assert.deepEqual(cpuTopology(flat), {
      logical: 2,
      physicalCores: 2,
      threadsPerCore: 1,
    });
  } finally {
    rmSync(flat, { recursive: true, force: true });
  }
});

test('cpuTopology is undefined where sysfs cannot be read', () => {
  assert.equal(cpuTopology(join(tmpdir(), 'no-such-sysfs-folder')), undefined);
  assert.equal(describeTopology(undefined), 'topology unknown');
});
