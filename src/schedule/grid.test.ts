import assert from 'node:assert/strict';
import { test } from 'node:test';
import { printSchedule } from '../cli/schedule.js';
import { LayerwiseError } from '../util/errors.js';
import {
  cellOf,
  gridToCsv,
  gridToText,
  peakInFlight,
  scheduleGrid,
} from './grid.js';
import {
  chainPlacement,
  gpipeCompute,
  oneFOneBCompute,
  zbH1Compute,
} from './schedule.js';

test("1f1b K=2 M=4 on time slots, as PyTorch's _dump_csv writes it (one row per device, empty cells idle)", () => {
  const grid = scheduleGrid(oneFOneBCompute(4, 2, 'always'), chainPlacement(2));
  assert.equal(
    gridToCsv(grid),
    '0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n' +
      ',1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,\n',
  );
  assert.match(gridToText(grid), /^slot +0 +1 .*\ndevice 0 +0F0 +0F1 +\. +0B0/);
});

test('every compute action sits in exactly one slot; a stage waits for its input (slot of stage s+1 > slot of stage s)', () => {
  for (const [m, k] of [
    [1, 1],
    [3, 2],
    [4, 3],
    [8, 4],
  ]) {
    for (const compute of [
      gpipeCompute(m, k, 'never'),
      oneFOneBCompute(m, k, 'never'),
    ]) {
      const grid = scheduleGrid(compute, chainPlacement(k));
      grid.forEach((row, d) => {
        const cells = row.filter((a) => a !== null).map(cellOf);
        assert.deepEqual(cells, compute[d].map(cellOf), `M=${m} K=${k}`);
      });
      const slot = (s: number, op: string, mb: number) =>
        grid[s].findIndex((a) => a?.op === op && 'mb' in a && a.mb === mb);
      for (let s = 0; s + 1 < k; s++)
        for (let mb = 0; mb < m; mb++) {
          assert.ok(slot(s + 1, 'forward', mb) > slot(s, 'forward', mb));
          assert.ok(slot(s, 'backward', mb) > slot(s + 1, 'backward', mb));
        }
    }
  }
});

test('peak activations: 1f1b and zb-h1 keep K - s micro-batches in flight on stage s, gpipe keeps M', () => {
  assert.deepEqual(peakInFlight(oneFOneBCompute(8, 4, 'always')), [4, 3, 2, 1]);
  assert.deepEqual(peakInFlight(gpipeCompute(8, 4, 'always')), [8, 8, 8, 8]);
  // ZB-H1 splits 1F1B's backwards in place: the same activations in flight
  assert.deepEqual(peakInFlight(zbH1Compute(8, 4, 'always')), [4, 3, 2, 1]);
});

test('layerwise schedule: grid, simulated bubble and peak activations; csv; bad input is a LayerwiseError', () => {
  const text = printSchedule({ schedule: 'gpipe', stages: 2, microBatches: 2 });
  // fill-drain at forward 1, backward 2: bubble (K-1)/(M+K-1) = 1/3
  assert.match(text, /simulated bubble .*device 0 0\.333, device 1 0\.333/);
  assert.match(text, /peak activations .*device 0 2, device 1 2/);
  assert.equal(
    printSchedule({
      schedule: '1f1b',
      stages: 2,
      microBatches: 4,
      format: 'csv',
    }),
    '0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,',
  );
  assert.throws(
    () => printSchedule({ schedule: 'zbx', stages: 2, microBatches: 2 }),
    (e) =>
      e instanceof LayerwiseError && /unknown schedule 'zbx'/.test(e.message),
  );
  assert.throws(
    () =>
      printSchedule({
        schedule: 'gpipe',
        stages: 2,
        microBatches: 2,
        format: 'xml',
      }),
    (e) =>
      e instanceof LayerwiseError && /unknown format 'xml'/.test(e.message),
  );
  // two stages per device: the V-shape's placement, and a bubble well under 1F1B's 1/5
  const zbv = printSchedule({ schedule: 'zbv', stages: 2, microBatches: 8 });
  assert.match(
    zbv,
    /2 devices \(2 stages each; stage->device 0->0 1->1 2->1 3->0\)/,
  );
  const bubbles = [...zbv.matchAll(/device \d (0\.\d+)/g)].map((x) =>
    Number(x[1]),
  );
  assert.equal(bubbles.length, 2);
  assert.ok(
    bubbles.every((b) => b < 0.05),
    `zbv bubbles ${bubbles}`,
  );
  assert.match(
    printSchedule({
      schedule: 'interleaved-1f1b',
      stages: 2,
      microBatches: 4,
      virtualStages: 3,
    }),
    /stage->device 0->0 1->1 2->0 3->1 4->0 5->1/,
  );
  assert.throws(
    () => printSchedule({ schedule: 'gpipe', stages: 0, microBatches: 2 }),
    LayerwiseError,
  );
});
