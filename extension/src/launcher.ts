/**
 * The launcher's "GPU Lab training run" tile: a new notebook whose one cell shows a LaunchPanel
 * (a form for the run's TrainConfig with a Launch button), opened with the default kernel.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';

export const LAUNCH_PANEL_SOURCE = 'import gpu_lab\ngpu_lab.LaunchPanel()';

export async function newTrainingNotebook(app: JupyterFrontEnd, cwd: string): Promise<unknown> {
  const { contents, kernelspecs } = app.serviceManager;
  await kernelspecs.ready;
  const specs = kernelspecs.specs;
  const kernel = specs?.default ?? 'python3';
  const spec = specs?.kernelspecs[kernel];
  const file = await contents.newUntitled({ path: cwd, type: 'notebook' });
  await contents.save(file.path, {
    type: 'notebook',
    format: 'json',
    content: {
      cells: [
        {
          cell_type: 'code',
          source: LAUNCH_PANEL_SOURCE,
          metadata: {},
          outputs: [],
          execution_count: null
        }
      ],
      metadata: {
        kernelspec: {
          name: kernel,
          display_name: spec?.display_name ?? kernel,
          language: spec?.language ?? 'python'
        }
      },
      nbformat: 4,
      nbformat_minor: 5
    }
  });
  return app.commands.execute('docmanager:open', {
    path: file.path,
    factory: 'Notebook',
    kernel: { name: kernel }
  });
}
