/** A bad test model module: no default export. */
export const notAModel = 1;
