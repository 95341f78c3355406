import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LayerwiseError } from '../util/errors.js';
import { loadScheduleCsv } from './csv.js';
import { gridToCsv, scheduleGrid } from './grid.js';
import {
  computeSchedule,
  lower,
  makeSchedule,
  placementOf,
  SCHEDULE_KINDS,
} from './schedule.js';

test('a printed CSV loads back as the same schedule: compute lists, placement and lowered lists equal the named one', () => {
  for (const kind of SCHEDULE_KINDS)
    for (const [m, k] of [
      [1, 1],
      [4, 2],
      [8, 3],
    ]) {
      if (kind === 'dualpipev' && m < 2 * k) continue;
      const compute = computeSchedule(kind, m, k, 'except_last');
      const placement = placementOf(kind, k);
      const csv = gridToCsv(scheduleGrid(compute, placement));
      const loaded = loadScheduleCsv(csv, 'except_last');
      assert.deepEqual(loaded.compute, compute, `${kind} M=${m} K=${k}`);
      assert.deepEqual(loaded.placement, placement);
      assert.equal(loaded.m, m);
      assert.deepEqual(
        lower(loaded.compute, loaded.placement, { step: 'all-reduce' }),
        makeSchedule(kind, m, k, 'except_last'),
      );
    }
});

test("PyTorch's compound cell (a;b)OVERLAP_F_B runs as its parts; CRLF and a trailing newline are accepted", () => {
  const loaded = loadScheduleCsv(
    '0F0,(0F1;0B0)OVERLAP_F_B,0B1\r\n,1F0,1B0,1F1,1B1\r\n',
  );
  assert.deepEqual(
    loaded.compute[0].map((a) => `${a.op}${'mb' in a ? a.mb : ''}`),
    ['forward0', 'forward1', 'backward0', 'backward1'],
  );
});

function refused(text: string, pattern: RegExp): void {
  assert.throws(
    () => loadScheduleCsv(text),
    (e) => {
      assert.ok(e instanceof LayerwiseError, String(e));
      assert.match(e.message, pattern);
      assert.match(e.message, /<-- ERROR HERE/);
      return true;
    },
  );
}

test('a bad file is refused naming the action, the schedule printed with its row marked', () => {
  // a missing backward
  refused(
    '0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,\n',
    /action 1B1 on device 1: missing[\s\S]*device 1: \. 1F0 1B0 1F1 \. {2}<-- ERROR HERE \(1B1\)/,
  );
  // two actions swapped into a deadlock: 0B0 waits for 1B0, which waits for 1F1, which needs 0F1
  refused(
    '0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n',
    /action 0B0 on device 0: deadlock[\s\S]*device 0: 0F0 0B0 0F1 0B1 {2}<-- ERROR HERE/,
  );
  // a backward before its forward on the same device
  refused('0B0,0F0\n', /action 0B0 on device 0: backward before forward/);
  // twice; a stage on two devices; bad syntax; a split backward half missing, or beside a B
  refused('0F0,0F0,0B0\n', /action 0F0 on device 0: appears twice/);
  refused('0F0,0B0\n0F1,0B1\n', /stage 0 also has actions on device 0/);
  refused('0F0,0X0\n', /0X0 on device 0: unknown type 'X'/);
  refused('0F0,hello\n', /action hello on device 0: not a cell/);
  refused('0F0,0I0\n', /action 0W0 on device 0: missing/);
  refused(
    '0F0,0I0,0W0,0B0\n',
    /action 0B0 on device 0: micro-batch 0 has both B and a split backward/,
  );
  // a weight part before its input part
  refused('0F0,0W0,0I0\n', /action 0W0 on device 0: .*before/);
});
