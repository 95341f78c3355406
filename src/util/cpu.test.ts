import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { cpuTopology, describeTopology } from './cpu.js';

/** A fake sysfs cpu folder: cpuN -> [package, core]. */
function fakeSysfs(cpus: [number, number][]): string {
  const root = mkdtempSync(join(tmpdir(), 'cpu-topology-'));
  cpus.forEach(([pkg, core], i) => {
    const dir = join(root, `cpu${i}`, 'topology');
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'physical_package_id'), `${pkg}\n`);
    writeFileSync(join(dir, 'core_id'), `${core}\n`);
  });
  mkdirSync(join(root, 'cpufreq')); // not a cpuN folder: ignored
  return root;
}

test('cpuTopology counts (package, core) pairs: SMT pairs share a core, the same core id on two packages does not', () => {
  // 2 packages x 2 cores x 2 threads: 8 logical CPUs on 4 cores
  const root = fakeSysfs([
    [0, 0],
    [0, 1],
    [1, 0],
    [1, 1],
    [0, 0],
    [0, 1],
    [1, 0],
    [1, 1],
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
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
  const flat = fakeSysfs([
    [0, 0],
    [0, 1],
  ]);
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
