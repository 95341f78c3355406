import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  integer,
  nonNegativeNumber,
  number,
  positiveInteger,
  positiveIntegers,
  positiveNumber,
  probability,
  wholeNumber,
} from './flags.js';

test('flag parsers take what they say and name the value they refuse', () => {
  const takes: [(v: string) => unknown, string, unknown][] = [
    [integer, ' -3 ', -3],
    [number, '2e-3', 0.002],
    [positiveInteger, '8', 8],
    [wholeNumber, '0', 0],
    [positiveNumber, '0.5', 0.5],
    [nonNegativeNumber, '0', 0],
    [probability, '0.99', 0.99],
    [positiveIntegers, '1, 2,16', [1, 2, 16]],
  ];
  for (const [parse, v, want] of takes)
    assert.deepEqual(parse(v), want, `${parse.name}('${v}')`);
  const refuses: [(v: string) => unknown, string][] = [
    [integer, '1e3'],
    [integer, '0x10'],
    [integer, '2.0'],
    [integer, ''],
    [number, 'fast'],
    [number, ' '],
    [number, 'Infinity'],
    [positiveInteger, '0'],
    [positiveInteger, '1.5'],
    [wholeNumber, '-1'],
    [positiveNumber, '0'],
    [positiveNumber, 'NaN'],
    [nonNegativeNumber, '-0.1'],
    [probability, '1'],
    [probability, '-0.1'],
    [positiveIntegers, '1,,2'],
    [positiveIntegers, '2,0'],
  ];
  for (const [parse, v] of refuses)
    assert.throws(
      () => parse(v),
      { code: 'commander.invalidArgument', message: /must be .*, got '/ },
      `${parse.name}('${v}')`,
    );
});
