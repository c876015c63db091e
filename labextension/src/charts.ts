/**
 * One small live time-series chart, drawn by uPlot on a canvas, in the theme's colours.
 *
 * A canvas cannot read CSS variables, so ChartPalette resolves JupyterLab's theme
 * variables to colours once, and again on a theme change; the charts read the palette
 * each time they draw, so a theme switch needs a redraw, not new charts.
 */

import uPlot from 'uplot';

import { formatClock } from './format';
import { IChartDef, ColorRole, tickIncrements, tickLabel } from './metrics';
import { Reading } from './protocol';

/** The JupyterLab theme variable behind each line colour. */
const COLOR_VARIABLES: Record<ColorRole, string> = {
  busy: '--jp-brand-color1',
  kernel: '--jp-ui-font-color2',
  memory: '--jp-accent-color1',
  power: '--jp-warn-color1',
  heat: '--jp-error-color1',
  send: '--jp-brand-color1',
  receive: '--jp-warn-color1'
};

/** Opacity of the area under a single line. */
const FILL_ALPHA = 0.18;

export const CHART_HEIGHT = 64;
const TIME_AXIS_HEIGHT = 22;
const VALUE_AXIS_WIDTH = 46;
const TIME_LABEL_HALF_WIDTH = 28;
/** Fixed padding (top, right, bottom, left): the same plot width on every chart, room for the end labels of the y axis. */
const PADDING: uPlot.Padding = [8, 4, 6, 0];

/** Colours resolved from the theme's CSS variables. */
export class ChartPalette {
  axis = '#757575';
  grid = '#e0e0e0';
  font = '10px sans-serif';
  private _lines = new Map<ColorRole, string>();
  private _fills = new Map<ColorRole, string>();

  /** Read the theme's current values through a probe element inside `host`. */
  refresh(host: HTMLElement): void {
    const probe = document.createElement('span');
    probe.style.display = 'none';
    host.appendChild(probe);
    const resolve = (variable: string): string => {
      probe.style.color = `var(${variable})`;
      return getComputedStyle(probe).color;
    };
    try {
      this.axis = resolve('--jp-ui-font-color2');
      this.grid = resolve('--jp-border-color2');
      const family = getComputedStyle(host)
        .getPropertyValue('--jp-ui-font-family')
        .trim();
      this.font = `10px ${family || 'sans-serif'}`;
      for (const role of Object.keys(COLOR_VARIABLES) as ColorRole[]) {
        const color = resolve(COLOR_VARIABLES[role]);
        this._lines.set(role, color);
        this._fills.set(role, withAlpha(color, FILL_ALPHA));
      }
    } finally {
      probe.remove();
    }
  }

  line(role: ColorRole): string {
    return this._lines.get(role) ?? this.axis;
  }

  fill(role: ColorRole): string {
    return this._fills.get(role) ?? 'transparent';
  }
}

/** "rgb(1, 2, 3)" -> "rgba(1, 2, 3, 0.2)"; other forms are returned unchanged. */
export function withAlpha(color: string, alpha: number): string {
  const match = /^rgba?\(\s*([\d.]+)[,\s]+([\d.]+)[,\s]+([\d.]+)/.exec(color);
  return match
    ? `rgba(${match[1]}, ${match[2]}, ${match[3]}, ${alpha})`
    : color;
}

export type ChartData = [number[], ...Reading[][]];

/** A uPlot chart for one IChartDef; the x range is set by the caller (the history's span). */
export class TimeChart {
  readonly def: IChartDef;
  readonly node: HTMLDivElement;
  private _plot: uPlot;
  private _xMin = 0;
  private _xMax = 1;

  constructor(
    def: IChartDef,
    palette: ChartPalette,
    options: { width: number; showTimeAxis: boolean }
  ) {
    this.def = def;
    this.node = document.createElement('div');
    this.node.className = 'jp-gpuwidget-plot';
    const single = def.lines.length === 1;
    const yMax = def.yMax;
    const plotOptions: uPlot.Options = {
      width: Math.max(50, options.width),
      height: CHART_HEIGHT + (options.showTimeAxis ? TIME_AXIS_HEIGHT : 0),
      padding: PADDING,
      legend: { show: false },
      cursor: { show: false, drag: { x: false, y: false } },
      select: { show: false, left: 0, top: 0, width: 0, height: 0 },
      scales: {
        x: { time: true, range: () => [this._xMin, this._xMax] },
        y: {
          range: (_u, _min, max) => [0, yMax ?? (max > 0 ? max * 1.1 : 1)]
        }
      },
      axes: [
        {
          // Always on for its vertical grid, which lines the charts up in time; only the
          // bottom chart of a card spends height on the labels.
          stroke: () => palette.axis,
          font: palette.font,
          size: options.showTimeAxis ? TIME_AXIS_HEIGHT : 0,
          space: 60,
          grid: { stroke: () => palette.grid, width: 1 },
          ticks: { show: false },
          // A label centred on a tick near the right edge would not fit: uPlot would pad
          // this chart, and only this one, to make room. Drop such labels instead.
          filter: (u, splits) =>
            splits.map(value =>
              u.valToPos(value, 'x') >
              u.bbox.width / uPlot.pxRatio - TIME_LABEL_HALF_WIDTH
                ? null
                : value
            ),
          values: (_u, splits, _axis, _space, increment) =>
            splits.map(value =>
              options.showTimeAxis && value !== null
                ? formatClock(value, increment < 60)
                : ''
            )
        },
        {
          stroke: () => palette.axis,
          font: palette.font,
          size: VALUE_AXIS_WIDTH,
          space: 20,
          incrs: tickIncrements(def.unit),
          grid: { stroke: () => palette.grid, width: 1 },
          ticks: { show: false },
          values: (_u, splits) =>
            splits.map(value => tickLabel(def.unit, value))
        }
      ],
      series: [
        {},
        ...def.lines.map(line => ({
          label: line.label,
          stroke: () => palette.line(line.color),
          fill: single ? () => palette.fill(line.color) : undefined,
          width: 1.25,
          points: { show: false },
          spanGaps: false
        }))
      ]
    };
    const empty: ChartData = [[], ...def.lines.map(() => [])];
    this._plot = new uPlot(plotOptions, empty as uPlot.AlignedData, this.node);
  }

  /** New data, drawn over [xMin, xMax] (seconds). */
  setData(data: ChartData, xMin: number, xMax: number): void {
    this._xMin = xMin;
    this._xMax = xMax;
    this._plot.setData(data as uPlot.AlignedData, true);
  }

  setWidth(width: number): void {
    const target = Math.max(50, Math.floor(width));
    if (target !== this._plot.width) {
      this._plot.setSize({ width: target, height: this._plot.height });
    }
  }

  /** Draw again with the palette's current colours. */
  redraw(): void {
    this._plot.redraw(false, true);
  }

  dispose(): void {
    this._plot.destroy();
    this.node.remove();
  }
}
