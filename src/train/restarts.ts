/**
 * Elastic restarts (`--max-restarts N`), as TorchElastic does: when a device is lost (its
 * process killed, its host unreachable), stop every device, start them again and resume from
 * the run's last checkpoint (or from the start, if none was saved yet), at most N times.
 * Failures of the run itself (bad input, a stage's error, out of memory) are not retried.
 */
import { resolveConfig } from '../config/config.js';
import { isDeviceLoss } from '../runtime/device.js';
import { LayerwiseError } from '../util/errors.js';
import { hasCheckpoint, restartCommand } from './checkpoint-io.js';
import {
  type TrainHooks,
  type TrainOptions,
  type TrainResult,
  train,
} from './trainer.js';

/**
 * {@link train}, restarted after each device loss up to `maxRestarts` times. `out`: the run
 * folder (whose checkpoint a restart resumes); `onRestart` hears each restart. A device lost
 * with no restart left ends the run as a {@link LayerwiseError} (a fault of the machines, not
 * a bug) that names the device and the command that resumes the run.
 */
export async function trainWithRestarts(
  raw: Parameters<typeof train>[0],
  resume: string | undefined,
  hooks: TrainHooks,
  maxRestarts: number,
  onRestart: (attempt: number, error: Error, from: string) => void = () =>
    undefined,
  opts: TrainOptions = {},
): Promise<TrainResult> {
  let from = resume;
  let overwrite = opts.overwrite;
  for (let attempt = 0; ; attempt++) {
    try {
      return await train(raw, from, hooks, { ...opts, overwrite });
    } catch (e) {
      if (!isDeviceLoss(e)) throw e;
      // where this run saves its checkpoints: --out, else the resumed folder, else the default
      const out = raw.out ?? resume ?? resolveConfig(raw).out;
      if (attempt >= maxRestarts) {
        const again = hasCheckpoint(out)
          ? `resume it with: layerwise train --resume ${out}`
          : `no checkpoint was saved yet: start it again with: ${restartCommand(out) ?? 'the same command and --overwrite'}`;
        throw new LayerwiseError(
          `${(e as Error).message.split('\n')[0]}; ${maxRestarts > 0 ? `no restart left (--max-restarts ${maxRestarts})` : 'the run stopped'}; ${again} (--max-restarts N restarts lost devices by itself)`,
        );
      }
      if (hasCheckpoint(out)) from = out;
      else overwrite = true; // lost before the first checkpoint: start over in the same folder
      onRestart(
        attempt + 1,
        e as Error,
        from === undefined ? 'the start' : `the checkpoint in ${from}`,
      );
    }
  }
}
