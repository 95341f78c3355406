/**
 * Elastic restarts (`--max-restarts N`), as TorchElastic does: when a device is lost (its
 * process killed, its host unreachable), stop every device, start them again and resume from
 * the run's last checkpoint (or from the start, if none was saved yet), at most N times.
 * Failures of the run itself (bad input, a stage's error, out of memory) are not retried.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { resolveConfig } from '../config/config.js';
import { StageError } from '../runtime/device.js';
import { checkpointDir } from './checkpoint-io.js';
import { type TrainHooks, type TrainResult, train } from './trainer.js';

/** Whether `e` is a lost device (gone, exited, crashed) rather than an error the stage raised. */
export const isDeviceLoss = (e: unknown): boolean =>
  e instanceof StageError && e.causeName === undefined;

/**
 * {@link train}, restarted after each device loss up to `maxRestarts` times. `out`: the run
 * folder (whose checkpoint a restart resumes); `onRestart` hears each restart.
 */
export async function trainWithRestarts(
  raw: Parameters<typeof train>[0],
  resume: string | undefined,
  hooks: TrainHooks,
  maxRestarts: number,
  onRestart: (attempt: number, error: Error, from: string) => void = () =>
    undefined,
): Promise<TrainResult> {
  let from = resume;
  for (let attempt = 0; ; attempt++) {
    try {
      return await train(raw, from, hooks);
    } catch (e) {
      if (!isDeviceLoss(e) || attempt >= maxRestarts) throw e;
      // where this run saves its checkpoints: --out, else the resumed folder, else the default
      const out = raw.out ?? resume ?? resolveConfig(raw).out;
      if (existsSync(join(checkpointDir(out), 'meta.json'))) from = out;
      onRestart(
        attempt + 1,
        e as Error,
        from === undefined ? 'the start' : `the checkpoint in ${from}`,
      );
    }
  }
}
