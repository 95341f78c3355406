/** A bad test model module: its builder throws. */
export default function build(): never {
  throw new Error('boom in the model builder');
}
