/** The sidebar tab's icon: a chip, drawn in the theme's icon colour (class jp-icon3). */

import { LabIcon } from '@jupyterlab/ui-components';

const CHIP_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 5h10a2 2 0 0 1 2 2v10a2 2 0 0 1-2 2H7a2 2 0 0 1-2-2V7a2 2 0 0 1 2-2zm0 2v10h10V7H7z"/>
    <path d="M9 9h6v6H9z"/>
    <path d="M8 1h2v3H8zM14 1h2v3h-2zM8 20h2v3H8zM14 20h2v3h-2zM1 8h3v2H1zM1 14h3v2H1zM20 8h3v2h-3zM20 14h3v2h-3z"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({ name: 'gpuwidget:gpu', svgstr: CHIP_SVG });
