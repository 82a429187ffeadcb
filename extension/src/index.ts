/**
 * gpu_lab's JupyterLab extension: wires the model to its views and registers the commands.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, Notification, WidgetTracker } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { CompareView } from './compare';
import { newTrainingNotebook } from './launcher';
import { GpuLabModel, IInfo, IRun, isActive } from './model';
import { RunEndNotices } from './notices';
import { GpuLabPanel } from './panel';
import { RunViewModel } from './runmodel';
import { RunView } from './runview';
import { GpuLabStatus } from './statusbar';

export * from './model';

const PLUGIN_ID = 'gpu_lab:plugin';

export namespace CommandIDs {
  export const openPanel = 'gpu-lab:open-panel';
  export const openTutorials = 'gpu-lab:open-tutorials';
  export const openRunDashboard = 'gpu-lab:open-run-dashboard';
  export const compareRuns = 'gpu-lab:compare-runs';
  export const stopRun = 'gpu-lab:stop-run';
  export const newTrainingRun = 'gpu-lab:new-training-run';
}

const chipSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 7h10v10H7z" fill-opacity="0.35"/>
    <path d="M9 2h2v3H9zM13 2h2v3h-2zM9 19h2v3H9zM13 19h2v3h-2zM2 9h3v2H2zM2 13h3v2H2zM19 9h3v2h-3zM19 13h3v2h-3z"/>
    <path d="M5 5h14v14H5zm2 2v10h10V7z"/>
  </g>
</svg>`;

export const gpuLabIcon = new LabIcon({ name: 'gpu_lab:chip', svgstr: chipSvg });

const plugin: JupyterFrontEndPlugin<GpuLabModel> = {
  id: PLUGIN_ID,
  description:
    'GPU Lab: live GPU and host telemetry, runs list, run views with controls, ' +
    'run comparison, a launcher tile and a status-bar item.',
  autoStart: true,
  optional: [ICommandPalette, ILayoutRestorer, IStatusBar, ILauncher],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null,
    launcher: ILauncher | null
  ): GpuLabModel => {
    const model = new GpuLabModel();
    const { commands, shell } = app;
    const tracker = new WidgetTracker<MainAreaWidget<RunView>>({ namespace: 'gpu-lab-run' });
    const compares = new WidgetTracker<MainAreaWidget<CompareView>>({
      namespace: 'gpu-lab-compare'
    });

    const addToMain = async <T extends Widget>(
      content: T,
      into: WidgetTracker<MainAreaWidget<T>>
    ): Promise<MainAreaWidget<T>> => {
      const widget = new MainAreaWidget({ content });
      widget.id = content.id;
      widget.title.icon = gpuLabIcon;
      await into.add(widget);
      shell.add(widget, 'main');
      shell.activateById(widget.id);
      return widget;
    };

    // a notification when a run ends, whose View opens the run's view
    new RunEndNotices(
      model,
      runId => void commands.execute(CommandIDs.openRunDashboard, { runId })
    );
    const stop = async (run: IRun): Promise<void> => {
      try {
        const after = await model.stopRun(run.id);
        if (isActive(after.status)) {
          // an end has its own notification (notices.ts)
          Notification.info(`Run ${run.name || run.id}: ${after.status}`, { autoClose: 4000 });
        }
      } catch (error) {
        Notification.error(`Could not stop run ${run.id}: ${(error as Error).message}`);
      }
    };

    const panel = new GpuLabPanel(model, {
      stop,
      openDashboard: run => void commands.execute(CommandIDs.openRunDashboard, { runId: run.id }),
      compare: (runIds, title) =>
        void commands.execute(CommandIDs.compareRuns, { runIds, title: title ?? '' }),
      openTutorials: () => void commands.execute(CommandIDs.openTutorials)
    });
    panel.title.icon = gpuLabIcon;
    shell.add(panel, 'left', { rank: 950 });
    restorer?.add(panel, panel.id);

    commands.addCommand(CommandIDs.openPanel, {
      label: 'GPU Lab: Show Panel',
      caption: 'Show the GPU Lab side panel (GPUs, host, runs)',
      icon: gpuLabIcon,
      execute: () => shell.activateById(panel.id)
    });

    commands.addCommand(CommandIDs.openTutorials, {
      label: 'GPU Lab: Open Tutorials Index',
      caption: 'Open the tutorials index notebook',
      execute: async () => {
        let info: IInfo;
        try {
          info = await model.info();
        } catch (error) {
          // a click, not a poll: say so now rather than retry behind the user's back
          Notification.error(`GPU Lab: could not reach the server: ${(error as Error).message}`);
          return;
        }
        if (!info.tutorials_index) {
          Notification.warning(
            'GPU Lab: no tutorials index (00_overview.ipynb) under the server root. ' +
              'Start JupyterLab with `make lab`, which serves notebooks/.'
          );
          return;
        }
        return commands.execute('docmanager:open', { path: info.tutorials_index });
      }
    });

    commands.addCommand(CommandIDs.openRunDashboard, {
      label: args => (args.runId ? `GPU Lab: Open Run ${args.runId}` : 'GPU Lab: Open Newest Run'),
      caption: "Open a run's view: metrics per rank, GPU and host, config, logs, controls",
      icon: gpuLabIcon,
      execute: async args => {
        let runId = args.runId as string | undefined;
        if (!runId) {
          const runs = await model.refreshRuns();
          if (!runs.length) {
            Notification.info('GPU Lab: no runs in the registry yet.');
            return;
          }
          runId = runs[0].id;
        }
        const open = tracker.find(w => w.content.runId === runId);
        if (open) {
          shell.activateById(open.id);
          return open;
        }
        const runModel = new RunViewModel(model, runId);
        const content = new RunView(runModel, {
          openRun: id => void commands.execute(CommandIDs.openRunDashboard, { runId: id })
        });
        const widget = await addToMain(content, tracker);
        try {
          await runModel.open();
        } catch (error) {
          Notification.error(`GPU Lab: could not open run ${runId}: ${(error as Error).message}`);
          widget.dispose();
          return;
        }
        return widget;
      }
    });

    commands.addCommand(CommandIDs.compareRuns, {
      label: 'GPU Lab: Compare Runs',
      caption: 'Overlay the curves of two or more runs, named by how their configs differ',
      icon: gpuLabIcon,
      isEnabled: args => Array.isArray(args.runIds) && (args.runIds as string[]).length >= 2,
      execute: async args => {
        const runIds = (args.runIds as string[]).slice();
        const open = compares.find(w => w.content.id === CompareView.idFor(runIds));
        if (open) {
          shell.activateById(open.id);
          open.content.refresh();
          return open;
        }
        return addToMain(new CompareView(model, runIds, args.title as string), compares);
      }
    });

    commands.addCommand(CommandIDs.newTrainingRun, {
      label: args =>
        args.isLauncher ? 'GPU Lab training run' : 'GPU Lab: New Training Run Notebook',
      caption: "A new notebook with a LaunchPanel: a form for the run's config and a Launch button",
      icon: gpuLabIcon,
      execute: async args => {
        try {
          return await newTrainingNotebook(app, (args.cwd as string) ?? '');
        } catch (error) {
          Notification.error(`GPU Lab: could not make the notebook: ${(error as Error).message}`);
        }
      }
    });
    if (launcher) {
      launcher.add({
        command: CommandIDs.newTrainingRun,
        args: { isLauncher: true },
        category: 'GPU Lab',
        rank: 1
      });
    }

    commands.addCommand(CommandIDs.stopRun, {
      label: args => `GPU Lab: Stop Run ${args.runId ?? ''}`.trim(),
      caption: 'Stop a run: SIGTERM to its process group, SIGKILL after a grace period',
      isEnabled: args => !!args.runId,
      execute: async args => {
        const run = model.runs.find(r => r.id === args.runId);
        await stop(run ?? ({ id: String(args.runId), name: '' } as IRun));
      }
    });

    if (restorer) {
      void restorer.restore(tracker, {
        command: CommandIDs.openRunDashboard,
        args: w => ({ runId: w.content.runId }),
        name: w => w.content.runId
      });
      void restorer.restore(compares, {
        command: CommandIDs.compareRuns,
        args: w => ({ runIds: w.content.runIds, title: w.content.title.label }),
        name: w => w.content.runIds.join(',')
      });
    }

    if (palette) {
      for (const command of [
        CommandIDs.openPanel,
        CommandIDs.openTutorials,
        CommandIDs.openRunDashboard,
        CommandIDs.newTrainingRun
      ]) {
        palette.addItem({ command, category: 'GPU Lab' });
      }
    }

    if (statusBar) {
      const item = new GpuLabStatus(model, () => shell.activateById(panel.id));
      statusBar.registerStatusItem('gpu_lab:status', {
        item,
        align: 'left',
        rank: 3
      });
    }

    model.start();
    return model;
  }
};

export default plugin;
