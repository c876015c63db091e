/**
 * The status-bar item: "GPU0 87% · 41/80 GB". It polls nothing of its own: it shows
 * what the sidebar's model last received (the stream while the panel is open, the
 * controller's small poll while it is closed), greyed out and in italics with a tooltip
 * saying how old the values are whenever they are not current, and opens the panel on
 * click (a button: Tab and Enter reach it too).
 */

import { Widget } from '@lumino/widgets';

import { statusSummary } from './metrics';
import { ModelChange, SidebarModel } from './model';

export class GpuStatusItem extends Widget {
  private _model: SidebarModel;

  constructor(model: SidebarModel, onClick: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('jp-gpuwidget-statusitem');
    this.node.setAttribute('type', 'button');
    this._model = model;
    // With this widget as thisArg, Widget.dispose() disconnects it (Signal.clearData).
    model.changed.connect(this._changed, this);
    this.node.addEventListener('click', onClick);
    // The tooltip says how old the values are: recompute it when it is about to show.
    this.node.addEventListener('mouseenter', () => this.refresh());
    this.refresh();
  }

  private _changed(_model: SidebarModel, change: ModelChange): void {
    if (change !== 'processes') {
      this.refresh();
    }
  }

  /** Redraw now (cheap: one line of text). */
  refresh(): void {
    const { devices, series, connection, stalled } = this._model;
    const summary = statusSummary(
      devices,
      series,
      connection,
      Date.now() / 1000,
      stalled
    );
    this.node.textContent = summary.text;
    this.node.title = summary.title;
    // The tooltip is for the mouse; a screen reader gets the same through the label.
    this.node.setAttribute(
      'aria-label',
      `GPU status: ${summary.text.replace(' ⚠', '')}${summary.stale ? ' (not current)' : ''}.` +
        `${summary.warning ? ` ${summary.warning}.` : ''} Opens the GPU panel.`
    );
    this.node.classList.toggle('jp-mod-stale', summary.stale);
  }
}
