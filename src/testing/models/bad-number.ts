/** A bad test model module: the default export is not a model. */
export default 42;
