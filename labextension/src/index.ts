import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';

/**
 * The plugin id; the lab extension's package name is "gpuwidget".
 */
export const PLUGIN_ID = 'gpuwidget:plugin';

/**
 * The gpuwidget front-end plugin.
 *
 * For now it only announces itself; the GPU sidebar is added to the left
 * area of the lab shell (when there is one) by a later change.
 */
const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Shows every GPU on the machine and which notebook holds it.',
  autoStart: true,
  requires: [],
  optional: [ILabShell],
  activate: (app: JupyterFrontEnd, labShell: ILabShell | null): void => {
    console.log('gpuwidget extension activated');
    if (!labShell) {
      // Not running inside JupyterLab's shell (e.g. Notebook 7's notebook view):
      // there is no left area to put a sidebar in.
      return;
    }
  }
};

export default plugin;
