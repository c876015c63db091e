// What jsdom lacks and Lumino touches on import or attach (as in @jupyterlab/testutils).
if (typeof window !== 'undefined') {
  const globals = globalThis as Record<string, unknown>;
  if (!('DragEvent' in globals)) {
    globals.DragEvent = class DragEvent extends MouseEvent {};
  }
  if (!('ResizeObserver' in globals)) {
    globals.ResizeObserver = class ResizeObserver {
      observe(): void {}
      unobserve(): void {}
      disconnect(): void {}
    };
  }
}
