import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { buildCommit } from './build-info.js';

test("the build records its checkout's commit in dist/build-info.json, and the benches name that one", (t) => {
  const file = fileURLToPath(new URL('../build-info.json', import.meta.url));
  if (!existsSync(file)) {
    t.skip('built outside a git checkout: nothing recorded');
    return;
  }
  const info = JSON.parse(readFileSync(file, 'utf8')) as {
    commit: string;
    dirty: boolean;
  };
  // a commit of this checkout (HEAD when built; it may have moved on since)
  const git = spawnSync('git', ['cat-file', '-e', `${info.commit}^{commit}`], {
    cwd: fileURLToPath(new URL('../..', import.meta.url)),
  });
  assert.equal(git.status, 0, `${info.commit} is no commit of this checkout`);
  assert.equal(typeof info.dirty, 'boolean');
  assert.equal(
    buildCommit(),
    info.dirty ? `${info.commit}+changes` : info.commit,
  );
});
