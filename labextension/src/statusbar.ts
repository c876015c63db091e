/**
 * The status-bar item: "GPU0 87% · 41/80 GB". It polls nothing of its own: it shows
 * what the sidebar's model last received, greyed out with a tooltip saying how old
 * it is while the panel is closed, and opens the panel on click.
 */

import { Widget } from '@lumino/widgets';

import { statusSummary } from './metrics';
import { ModelChange, SidebarModel } from './model';

export class GpuStatusItem extends Widget {
  private _model: SidebarModel;

  constructor(model: SidebarModel, onClick: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('jp-gpuwidget-statusitem');
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
    const { devices, series, connection } = this._model;
    const summary = statusSummary(
      devices,
      series,
      connection,
      Date.now() / 1000
    );
    this.node.textContent = summary.text;
    this.node.title = summary.title;
    this.node.classList.toggle('jp-mod-stale', summary.stale);
  }
}
