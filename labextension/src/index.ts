/**
 * The gpuwidget front-end plugin: the GPU sidebar, its status-bar item and settings, and the
 * renderer of the Measure button under watched cells.
 *
 * Wiring only; the logic lives in the modules it assembles.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { IThemeManager } from '@jupyterlab/apputils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { ServerConnection } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

// Activation builds the sidebar and its status item at once (they show the GPUs from the
// first frame), so these modules are needed at start anyway: nothing to load lazily.
/* eslint-disable jupyter/prefer-lazy-imports */
import { ServerApi } from './api';
import { SidebarController } from './controller';
import { gpuIcon } from './icon';
import { SidebarModel } from './model';
import { MEASURE_RANK, SessionLink, measureFactory } from './measure';
import type { IRenderMimeLike } from './measure';
import { GpuPanel } from './panel';
import { DEFAULT_SETTINGS, ISidebarSettings, readSettings } from './settings';
import { GpuStatusItem } from './statusbar';
/* eslint-enable jupyter/prefer-lazy-imports */

/**
 * The plugin id: the lab extension's package name ("jupyterlab-gpuwidget"), then the settings
 * schema's file name (labextension/schema/plugin.json), as JupyterLab finds settings by it.
 */
export const PLUGIN_ID = 'jupyterlab-gpuwidget:plugin';

const OPEN_COMMAND = 'gpuwidget:open-sidebar';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Shows every GPU on the machine and which notebook holds it.',
  autoStart: true,
  requires: [],
  optional: [
    ILayoutRestorer,
    IStatusBar,
    ISettingRegistry,
    IDocumentManager,
    IThemeManager
  ],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    docManager: IDocumentManager | null,
    themeManager: IThemeManager | null
  ): void => {
    // The Measure button under a watched cell's panel: each notebook renders it with its own
    // kernel (its rendermime is the notebook's own copy), ahead of the widget manager.
    app.docRegistry.addWidgetExtension('Notebook', {
      createNew: (notebook, context) => {
        const rendermime = (
          notebook as unknown as { content?: { rendermime?: IRenderMimeLike } }
        ).content?.rendermime;
        rendermime?.addFactory(
          measureFactory(new SessionLink(context.sessionContext), rendermime),
          MEASURE_RANK
        );
      }
    });

    const serverSettings = app.serviceManager.serverSettings;
    const api = new ServerApi(serverSettings, (url, init) =>
      ServerConnection.makeRequest(url, init, serverSettings)
    );
    const model = new SidebarModel(DEFAULT_SETTINGS.interval);
    const controller = new SidebarController(api, model);

    const panel = new GpuPanel({
      model,
      onVisibilityChange: visible => controller.setVisible(visible),
      onRetry: () => controller.retry(),
      openNotebook: docManager
        ? path => void docManager.openOrReveal(path)
        : null
    });
    panel.title.icon = gpuIcon;
    panel.title.caption = 'GPUs';
    // Works in any shell with a left area (JupyterLab, and Notebook 7's views).
    app.shell.add(panel, 'left', { rank: 800 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(OPEN_COMMAND, {
      label: 'Show GPU Sidebar',
      describedBy: { args: { type: 'object', properties: {} } },
      execute: () => app.shell.activateById(panel.id)
    });

    // Keep the status bar current while the panel is closed (a small poll), except in a
    // background tab, where nobody reads it.
    controller.setPageVisible(document.visibilityState !== 'hidden');
    document.addEventListener('visibilitychange', () =>
      controller.setPageVisible(document.visibilityState !== 'hidden')
    );
    if (statusBar) {
      controller.pollWhileClosed(DEFAULT_SETTINGS.statusInterval);
      const item = new GpuStatusItem(
        model,
        () => void app.commands.execute(OPEN_COMMAND)
      );
      statusBar.registerStatusItem(`${PLUGIN_ID}:status`, {
        item,
        align: 'left',
        rank: 100
      });
    }

    themeManager?.themeChanged.connect(() => {
      // The new theme's CSS is in place by the next frame.
      requestAnimationFrame(() => panel.refreshTheme());
    });

    if (settingRegistry) {
      const apply = (settings: ISidebarSettings) => {
        controller.setInterval(settings.interval);
        panel.setMetrics(settings.metrics);
        if (statusBar) {
          controller.pollWhileClosed(settings.statusInterval);
        }
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(readSettings(settings.composite as Record<string, unknown>));
          settings.changed.connect(() =>
            apply(readSettings(settings.composite as Record<string, unknown>))
          );
        })
        .catch(reason =>
          console.warn('gpuwidget: settings not loaded', reason)
        );
    }
  }
};

export default plugin;
