/**
 * Seeded pseudo-random numbers, identical on every backend and thread, so that parameter
 * initialisation and data shuffling depend only on the seed (never on the device).
 * Algorithm: mulberry32 (Tommy Ettinger), 32-bit state; normals by Box-Muller.
 */
export class Rng {
  private state: number;
  constructor(seed: number) {
    this.state = (seed >>> 0) ^ 0x9e3779b9;
  }
  /** Uniform float in [0, 1). */
  next(): number {
    let t = (this.state = (this.state + 0x6d2b79f5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  /** Uniform integer in [0, n). */
  int(n: number): number {
    return Math.floor(this.next() * n);
  }
  /** Standard normal sample (Box-Muller). */
  normal(): number {
    let u = this.next();
    while (u <= Number.EPSILON) u = this.next();
    const v = this.next();
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
  }
  /** Fisher-Yates shuffle of `a` in place; returns `a`. */
  shuffle<T extends { length: number; [i: number]: unknown }>(a: T): T {
    for (let i = a.length - 1; i > 0; i--) {
      const j = this.int(i + 1);
      const tmp = a[i];
      a[i] = a[j];
      a[j] = tmp;
    }
    return a;
  }
  /** The internal state, for checkpoints. */
  getState(): number {
    return this.state;
  }
  /** Restore a state from {@link getState}. */
  setState(s: number): void {
    this.state = s >>> 0;
  }
}
