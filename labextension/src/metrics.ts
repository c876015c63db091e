/**
 * Which charts a GPU and the host get, what each chart plots, and the one-line
 * readouts (chart titles, status bar) -- as data and pure functions; charts.ts draws.
 */

import {
  formatAge,
  formatBytesOf,
  formatBytesTick,
  formatCelsius,
  formatPercent,
  formatRate,
  formatWattsOf,
  shortNumber
} from './format';
import {
  ConnectionState,
  IStalledState,
  NOTHING_STALLED,
  SeriesBuffer,
  latestReading,
  staleAgeS
} from './model';
import {
  IDeviceInfo,
  IDevicesReply,
  IHostInfo,
  IStaleDevice,
  Reading
} from './protocol';

/** The GPU charts a user can choose in the settings (schema: `metrics`). */
export type GpuMetric =
  'utilization' | 'memory' | 'power' | 'temperature' | 'pcie';

export const GPU_METRICS: GpuMetric[] = [
  'utilization',
  'memory',
  'power',
  'temperature',
  'pcie'
];

/** A line's colour, by meaning; charts.ts maps each to a JupyterLab CSS variable. */
export type ColorRole =
  'busy' | 'kernel' | 'memory' | 'power' | 'heat' | 'send' | 'receive';

export type Unit = 'percent' | 'bytes' | 'watts' | 'celsius' | 'rate';

export interface IChartLine {
  /** Metric name in the server's messages, e.g. `gpu0.util`. */
  column: string;
  label: string;
  color: ColorRole;
}

export type Latest = (column: string) => Reading;

export interface IChartDef {
  /** Unique within the panel, e.g. `gpu0/utilization`. */
  key: string;
  title: string;
  lines: IChartLine[];
  unit: Unit;
  /** Top of the y scale when it is known (100%, memory size, power limit); else it follows the data. */
  yMax: number | null;
  /** The current value(s) for the chart's title, e.g. "41/80 GB". */
  readout(latest: Latest): string;
}

function positive(value: number | null | undefined): number | null {
  return typeof value === 'number' && value > 0 ? value : null;
}

/**
 * How busy a GPU is, as dcgm-exporter names it: "SM active" (GPM's SM activity, Hopper and newer,
 * MIG instances included) where the server reads it, else NVML's utilisation, which is only the
 * share of time some kernel ran: "kernel running", nvidia-smi's GPU-Util.
 */
export function busyColumn(device: IDeviceInfo): string {
  return device.gpm ? `${device.id}.sm_active` : `${device.id}.util`;
}

export const SM_ACTIVE_LABEL = 'SM active';
export const KERNEL_RUNNING_LABEL = 'kernel running (nvidia-smi)';

/** "SM active 6% · kernel running 92%", "kernel running (nvidia-smi) 92%": both figures where known. */
export function busyText(device: IDeviceInfo, latest: Latest): string {
  const running = latest(`${device.id}.util`);
  if (!device.gpm) {
    return `${KERNEL_RUNNING_LABEL} ${formatPercent(running)}`;
  }
  const sm = `${SM_ACTIVE_LABEL} ${formatPercent(latest(busyColumn(device)))}`;
  return running === null
    ? sm
    : `${sm} · kernel running ${formatPercent(running)}`;
}

/** The charts of one GPU, in the settings' order of `metrics`. */
export function gpuCharts(
  device: IDeviceInfo,
  metrics: GpuMetric[],
  latest: Latest
): IChartDef[] {
  const id = device.id;
  const memoryTotal =
    positive(device.memory_total) ?? positive(latest(`${id}.mem_total`));
  const powerLimit =
    positive(device.power_limit) ?? positive(latest(`${id}.power_limit`));
  const charts: Record<GpuMetric, IChartDef> = {
    utilization: device.gpm
      ? {
          key: `${id}/utilization`,
          title: 'SM active',
          // Beside SM activity, the share of time some kernel ran (a MIG instance has none).
          lines: [
            { column: `${id}.sm_active`, label: 'SM active', color: 'busy' },
            ...(device.is_mig
              ? []
              : [
                  {
                    column: `${id}.util`,
                    label: 'kernel running',
                    color: 'kernel' as ColorRole
                  }
                ])
          ],
          unit: 'percent',
          yMax: 100,
          readout: at => {
            const running = at(`${id}.util`);
            const sm = formatPercent(at(`${id}.sm_active`));
            return running === null
              ? sm
              : `${sm} · kernel ${formatPercent(running)}`;
          }
        }
      : {
          key: `${id}/utilization`,
          title: 'Utilization',
          lines: [
            { column: `${id}.util`, label: 'kernel running', color: 'busy' }
          ],
          unit: 'percent',
          yMax: 100,
          readout: at => formatPercent(at(`${id}.util`))
        },
    memory: {
      key: `${id}/memory`,
      title: 'Memory',
      lines: [{ column: `${id}.mem_used`, label: 'used', color: 'memory' }],
      unit: 'bytes',
      yMax: memoryTotal,
      readout: at =>
        formatBytesOf(
          at(`${id}.mem_used`),
          memoryTotal ?? at(`${id}.mem_total`)
        )
    },
    power: {
      key: `${id}/power`,
      title: 'Power',
      lines: [{ column: `${id}.power`, label: 'draw', color: 'power' }],
      unit: 'watts',
      yMax: powerLimit,
      readout: at => formatWattsOf(at(`${id}.power`), powerLimit)
    },
    temperature: {
      key: `${id}/temperature`,
      title: 'Temperature',
      lines: [{ column: `${id}.temperature`, label: 'core', color: 'heat' }],
      unit: 'celsius',
      yMax: null,
      readout: at => formatCelsius(at(`${id}.temperature`))
    },
    pcie: {
      key: `${id}/pcie`,
      title: 'PCIe',
      lines: [
        { column: `${id}.pcie_tx`, label: 'to host', color: 'send' },
        { column: `${id}.pcie_rx`, label: 'to GPU', color: 'receive' }
      ],
      unit: 'rate',
      yMax: null,
      readout: at =>
        `↓ ${formatRate(at(`${id}.pcie_rx`))} ↑ ${formatRate(at(`${id}.pcie_tx`))}`
    }
  };
  return metrics
    .filter(metric => metric in charts)
    .map(metric => charts[metric]);
}

/** Host CPU (all cores) and memory. */
export function hostCharts(
  host: IHostInfo | null,
  latest: Latest
): IChartDef[] {
  const memTotal = positive(host?.mem_total) ?? positive(latest('mem.total'));
  return [
    {
      key: 'host/cpu',
      title: 'CPU',
      lines: [{ column: 'cpu.util', label: 'all cores', color: 'busy' }],
      unit: 'percent',
      yMax: 100,
      readout: at => formatPercent(at('cpu.util'))
    },
    {
      key: 'host/memory',
      title: 'Memory',
      lines: [{ column: 'mem.used', label: 'used', color: 'memory' }],
      unit: 'bytes',
      yMax: memTotal,
      readout: at => formatBytesOf(at('mem.used'), memTotal ?? at('mem.total'))
    }
  ];
}

/**
 * The charts worth drawing: those with at least one reading. Before any data arrives
 * every chart is kept (they fill in a moment later); afterwards a metric the device
 * never reported is listed in `unreported` instead of being drawn empty.
 */
export function splitReported(
  charts: IChartDef[],
  series: SeriesBuffer
): { shown: IChartDef[]; unreported: IChartDef[] } {
  if (series.length === 0) {
    return { shown: charts, unreported: [] };
  }
  const shown: IChartDef[] = [];
  const unreported: IChartDef[] = [];
  for (const chart of charts) {
    (chart.lines.some(line => series.has(line.column))
      ? shown
      : unreported
    ).push(chart);
  }
  return { shown, unreported };
}

/**
 * Tick steps of a byte (or byte-rate) axis: round numbers of the unit its labels and the
 * readouts use (1 GB = 2^30 bytes, format.ts), so an 80 GB GPU's axis reads 0, 40G, 80G beside
 * "35/80 GB", never uPlot's decimal steps (50e9 bytes would read "47G").
 */
const BINARY_STEPS = [1, 2, 2.5, 4, 5, 10, 20, 25, 40, 50, 100, 200, 250, 500];
export const BYTE_TICK_INCREMENTS: number[] = [];
for (let exponent = 0; exponent <= 5; exponent++) {
  for (const step of BINARY_STEPS) {
    BYTE_TICK_INCREMENTS.push(step * 1024 ** exponent);
  }
}

/** The tick steps an axis of `unit` takes; undefined: uPlot's own (decimal) steps. */
export function tickIncrements(unit: Unit): number[] | undefined {
  return unit === 'bytes' || unit === 'rate' ? BYTE_TICK_INCREMENTS : undefined;
}

/** Axis tick labels per unit, kept short for a narrow panel. */
export function tickLabel(unit: Unit, value: number): string {
  switch (unit) {
    case 'percent':
      return `${Math.round(value)}%`;
    case 'bytes':
      return formatBytesTick(value);
    case 'rate':
      return `${formatBytesTick(value)}/s`;
    case 'watts':
      return `${shortNumber(value)}W`;
    case 'celsius':
      return `${Math.round(value)}°`;
  }
}

/**
 * "GPU0" for the first device, as its driver (nvidia-smi, amd-smi) numbers it where the server says
 * (`driver_index`);
 * a MIG instance "GPU0/GI5": its GPU and its GPU instance id, as nvidia-smi and dcgm-exporter name it.
 */
export function deviceLabel(device: IDeviceInfo): string {
  const gpu = `GPU${device.driver_index ?? device.index}`;
  if (
    device.is_mig &&
    device.gpu_instance_id !== null &&
    device.gpu_instance_id !== undefined
  ) {
    return `${gpu}/GI${device.gpu_instance_id}`;
  }
  return gpu;
}

/** "87% · 41/80 GB" for one GPU from the newest readings ("SM 6% · ..." where SM activity is read). */
export function gpuReadout(device: IDeviceInfo, latest: Latest): string {
  const id = device.id;
  const memoryTotal =
    positive(device.memory_total) ?? latest(`${id}.mem_total`);
  const busy = formatPercent(latest(busyColumn(device)));
  return `${device.gpm ? `SM ${busy}` : busy} · ${formatBytesOf(latest(`${id}.mem_used`), memoryTotal)}`;
}

/** A stale device in words: short for a row or a card's header, in full for a tooltip. */
export interface IStaleNote {
  /** "stopped 12 s ago". */
  short: string;
  /** "GPU5 stopped answering 12 s ago; its last values are shown, greyed." */
  full: string;
}

/**
 * What to say of a device whose readings stopped: `sinceS` seconds ago (as the sidebar's notice
 * counts them), its last values read `ageS` seconds ago (null: it never answered). A device that
 * stopped with another's source (one source read both) says so.
 */
export function staleNote(
  device: IDeviceInfo,
  stale: IStaleDevice,
  sinceS: number | null,
  ageS: number | null
): IStaleNote {
  const since = sinceS === null ? '' : ` ${formatAge(sinceS)}`;
  const label = deviceLabel(device);
  const shown =
    stale.t === null || ageS === null
      ? 'it gave no values before.'
      : `its last values (read ${formatAge(ageS)}) are shown, greyed.`;
  const stopped = stale.hung
    ? `${label} stopped answering${since}`
    : `${label} is no longer read: ${stale.source}, read by the same source, stopped answering${since}`;
  return {
    short: sinceS === null ? 'stopped answering' : `stopped${since}`,
    full: `${stopped}; ${shown}`
  };
}

/** The stale note of `device` as of `nowS`, or null while its readings go on. */
export function staleNoteOf(
  device: IDeviceInfo,
  stalled: IStalledState,
  nowS: number
): IStaleNote | null {
  const stale = stalled.devices[device.id];
  if (!stale) {
    return null;
  }
  const ageS = staleAgeS(stalled, device.id, nowS);
  const source = stalled.sources.find(entry => entry.source === stale.source);
  const sinceS = source
    ? source.since_s + Math.max(0, nowS - stalled.receivedS)
    : ageS;
  return staleNote(device, stale, sinceS, ageS);
}

export interface IStatusSummary {
  text: string;
  title: string;
  /** True when the values are not being updated (panel closed or connection lost). */
  stale: boolean;
  /** What stopped answering ("GPU5 stopped answering 12 s ago"), or null. */
  warning: string | null;
}

/** A poll's values count as current for this many poll periods (one lost answer is no news). */
export const POLL_FRESH_PERIODS = 3;

/**
 * The status bar's tooltip line about where the values come from, and whether they are
 * stale (not being updated).
 */
function freshness(
  connection: ConnectionState,
  age: string | null,
  ageS: number | null
): { line: string | null; stale: boolean } {
  const from = age ? `Values from ${age}: ` : '';
  switch (connection.kind) {
    case 'live':
      return { line: null, stale: false };
    case 'polling':
      if (connection.error) {
        return {
          line: `${from}the server did not answer (${connection.error}); asking again every ${connection.everyS} s.`,
          stale: true
        };
      }
      if (ageS === null || ageS > POLL_FRESH_PERIODS * connection.everyS) {
        return {
          line: `${from}waiting for the server (asked every ${connection.everyS} s).`,
          stale: true
        };
      }
      return {
        line: `Updated every ${connection.everyS} s while the GPU panel is closed. Click to open it.`,
        stale: false
      };
    case 'stopped':
      return {
        line: age
          ? `${from}nothing is polled while the GPU panel is closed. Click to open it.`
          : 'Click to open the GPU panel (nothing is polled while it is closed).',
        stale: true
      };
    case 'connecting':
      return { line: `${from}connecting to the server.`, stale: true };
    case 'retrying':
      return {
        line: `${from}lost the connection to the server (${connection.reason}); retrying.`,
        stale: true
      };
    case 'missing':
      return {
        line: 'The gpuwidget server extension is not running on this Jupyter server.',
        stale: true
      };
  }
}

/**
 * The status-bar line: "GPU0 87% · 41/80 GB" (and "+3" more GPUs), "No GPU · CPU 12%"
 * on a machine without one. While the panel is closed the controller polls the latest
 * values every few seconds; whenever they are not current the line keeps the last
 * values and its tooltip says how old they are and why. A GPU that stopped answering
 * keeps its last values too, the line ends in "⚠" and the tooltip says which and since
 * when; the others stay live.
 */
export function statusSummary(
  devices: IDevicesReply | null,
  series: SeriesBuffer,
  connection: ConnectionState,
  nowS: number,
  stalled: IStalledState = NOTHING_STALLED
): IStatusSummary {
  const latest: Latest = column => latestReading(series, stalled, column);
  const lastTime = series.lastTime();
  let text: string;
  const lines: string[] = [];
  const warnings: string[] = [];
  if (!devices || lastTime === null) {
    text = 'GPU';
  } else if (!devices.gpu_found || devices.devices.length === 0) {
    text = `No GPU · CPU ${formatPercent(latest('cpu.util'))}`;
    lines.push(devices.message ?? 'No GPU found.');
  } else {
    const [first, ...others] = devices.devices;
    text = `${deviceLabel(first)} ${gpuReadout(first, latest)}`;
    if (others.length) {
      text += ` +${others.length}`;
    }
    for (const device of devices.devices) {
      const note = staleNoteOf(device, stalled, nowS);
      if (note) {
        warnings.push(note.full.slice(0, note.full.indexOf(';')));
      }
      lines.push(
        `${deviceLabel(device)} ${device.name}: ${busyText(device, latest)} · ${formatBytesOf(latest(`${device.id}.mem_used`), positive(device.memory_total) ?? latest(`${device.id}.mem_total`))}${note ? ` (${note.full})` : ''}`
      );
    }
  }
  const ageS = lastTime === null ? null : Math.max(0, nowS - lastTime);
  const { line, stale } = freshness(
    connection,
    ageS === null ? null : formatAge(ageS),
    ageS
  );
  if (line) {
    lines.push(line);
  }
  if (warnings.length) {
    text += ' ⚠';
  }
  return {
    text,
    title: lines.join('\n'),
    stale,
    warning: warnings.length ? warnings.join('; ') : null
  };
}
