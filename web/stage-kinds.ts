/**
 * The stage kinds a browser device can run, registered by module path: a bundle has no module
 * tree for pipeline/stage-kind.ts's dynamic import, so each Web Worker device imports them
 * all statically (see registerStageKind).
 */
import { createStage as localStage } from '../src/pipeline/local-stage.js';
import { createStage as relayStage } from '../src/pipeline/relay-stage.js';
import { createStage as backpropStage } from '../src/pipeline/stage.js';
import { registerStageKind } from '../src/pipeline/stage-kind.js';

registerStageKind('pipeline/stage.js', backpropStage);
registerStageKind('pipeline/local-stage.js', localStage);
registerStageKind('pipeline/relay-stage.js', relayStage);
