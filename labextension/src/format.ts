/**
 * Numbers as the sidebar shows them: short, with units, and a dash for "no reading".
 *
 * Byte sizes use binary multiples with the short names people read on the GPU's box and
 * in nvidia-smi (an "80 GB" H100 has 80 GiB), so 1 GB here is 2^30 bytes.
 */

export const NO_VALUE = '–';

const BYTE_UNITS = ['B', 'KB', 'MB', 'GB', 'TB', 'PB'];

function isReading(value: number | null | undefined): value is number {
  return typeof value === 'number' && Number.isFinite(value);
}

/** One decimal below 10, none above: "7.3", "41", "0.5". */
export function shortNumber(value: number): string {
  const digits = Math.abs(value) < 10 && value !== Math.round(value) ? 1 : 0;
  return value.toFixed(digits);
}

/** The binary unit exponent that shows `bytes` as a number below 1024. */
function byteExponent(bytes: number): number {
  let exponent = 0;
  let scaled = Math.abs(bytes);
  while (scaled >= 1024 && exponent < BYTE_UNITS.length - 1) {
    scaled /= 1024;
    exponent += 1;
  }
  return exponent;
}

export function formatBytes(bytes: number | null | undefined): string {
  if (!isReading(bytes)) {
    return NO_VALUE;
  }
  const exponent = byteExponent(bytes);
  return `${shortNumber(bytes / 1024 ** exponent)} ${BYTE_UNITS[exponent]}`;
}

/** "41/80 GB": both in the unit of the total, so the two read together. */
export function formatBytesOf(
  used: number | null | undefined,
  total: number | null | undefined
): string {
  if (!isReading(total) || total <= 0) {
    return formatBytes(used);
  }
  const exponent = byteExponent(total);
  const scale = 1024 ** exponent;
  const usedText = isReading(used) ? shortNumber(used / scale) : NO_VALUE;
  return `${usedText}/${shortNumber(total / scale)} ${BYTE_UNITS[exponent]}`;
}

/** Bytes per second: "1.2 GB/s". */
export function formatRate(bytesPerSecond: number | null | undefined): string {
  return isReading(bytesPerSecond)
    ? `${formatBytes(bytesPerSecond)}/s`
    : NO_VALUE;
}

export function formatPercent(percent: number | null | undefined): string {
  return isReading(percent) ? `${Math.round(percent)}%` : NO_VALUE;
}

export function formatWatts(watts: number | null | undefined): string {
  return isReading(watts) ? `${Math.round(watts)} W` : NO_VALUE;
}

/** "250/700 W" when the limit is known. */
export function formatWattsOf(
  watts: number | null | undefined,
  limit: number | null | undefined
): string {
  if (!isReading(limit)) {
    return formatWatts(watts);
  }
  const used = isReading(watts) ? String(Math.round(watts)) : NO_VALUE;
  return `${used}/${Math.round(limit)} W`;
}

export function formatCelsius(celsius: number | null | undefined): string {
  return isReading(celsius) ? `${Math.round(celsius)} °C` : NO_VALUE;
}

/** Short axis tick labels: "80G", "512M", "1.5K". */
export function formatBytesTick(bytes: number): string {
  const exponent = byteExponent(bytes);
  const unit = exponent === 0 ? '' : BYTE_UNITS[exponent][0];
  return `${shortNumber(bytes / 1024 ** exponent)}${unit}`;
}

/** A clock time for a time axis, in the user's locale: "14:05" or "2:05 PM" (with seconds on request). */
export function formatClock(epochS: number, seconds = false): string {
  return new Date(epochS * 1000).toLocaleTimeString([], {
    hour: '2-digit',
    minute: '2-digit',
    second: seconds ? '2-digit' : undefined
  });
}

/** How long ago, coarsely: "just now", "40 s ago", "5 min ago", "2 h ago". */
export function formatAge(seconds: number): string {
  if (seconds < 2) {
    return 'just now';
  }
  if (seconds < 90) {
    return `${Math.round(seconds)} s ago`;
  }
  if (seconds < 90 * 60) {
    return `${Math.round(seconds / 60)} min ago`;
  }
  return `${Math.round(seconds / 3600)} h ago`;
}

/** A notebook path's file name: "experiments/train.ipynb" -> "train.ipynb". */
export function baseName(path: string): string {
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

/**
 * What to say under "No GPU found", from the server's message: the server's
 * reason without repeating the headline ("no GPU found (the NVIDIA driver is not loaded)" ->
 * "the NVIDIA driver is not loaded"); empty when it says nothing more.
 */
export function noGpuDetail(message: string | null | undefined): string {
  if (!message) {
    return '';
  }
  const trimmed = message.trim();
  const headline = /^no (?:nvidia |amd )?gpus? (?:was |were )?found\s*/i;
  if (!headline.test(trimmed)) {
    return trimmed;
  }
  return trimmed
    .replace(headline, '')
    .replace(/^[:\-–—,]\s*/, '')
    .replace(/^\((.*)\)\.?$/s, '$1')
    .trim();
}
