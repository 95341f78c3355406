/** A bad test model module: the residual model without groups, so its skip connection crosses a block boundary. */
import { residual } from './residual.js';

export default residual;
