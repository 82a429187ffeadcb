"""LaunchPanel: a form generated from TrainConfig's fields, Launch / Stop / Checkpoint-now
buttons, a Resume action for stopped or failed runs, and the Dashboard of the run it launched.

The form is built from `TrainConfig.field_help()`: each field gets the input its type calls for,
its help text, and an inline message when its value is refused — the message is TrainConfig's own,
so the form and the Python API can never disagree about what is valid. Launch calls
`gpu_lab.launch(train_fn, config, detach=...)`, which returns at once: the kernel, and therefore
every button here, stays responsive during training. Choosing a run to resume loads its config
into the form (change what may change, such as max_steps); Resume launches a new run from its
newest checkpoint, and a config that no longer fits the checkpoint is refused with the fields named.
"""
from __future__ import annotations

import html
import re
import threading
from typing import Any, Callable

import ipywidgets as W

from ..config import TrainConfig
from ..record.events import FINAL_STATUSES
from .dashboard import Dashboard

#: Form sections (field order within a section follows this list; fields that no section names
#: land in "other", so a new TrainConfig field shows up without touching this file).
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("run", ("model", "num_processes", "gpus", "priority", "mixed_precision", "max_steps", "epochs", "batch_size", "lr",
             "data_dir")),
    ("optimisation", ("optimizer", "scheduler", "warmup_ratio", "weight_decay", "momentum",
                      "step_size", "gamma", "grad_accum_steps", "max_grad_norm")),
    ("memory and speed", ("activation_checkpointing", "channels_last", "compile", "powersgd",
                          "zero", "memory_threshold", "oom_retry", "profile_steps")),
    ("data", ("image_size", "num_classes", "num_workers", "augment", "decode", "seed")),
    ("checkpoints and logging", ("output_dir", "checkpoint_every", "keep_last", "resume",
                                 "eval_every", "log_every", "tensorboard")),
)

_FIELD_RE = re.compile(r"TrainConfig\.(\w+)")
_DESC = {"description_width": "150px"}
_EMPTY = {"num_processes": "auto", "gpus": "one per process"}  # what an empty optional field means


class Field:
    """One form row: the input, the help text and the inline validation message."""

    def __init__(self, name: str, info: dict[str, Any], value: Any) -> None:
        self.name = name
        self.info = info
        typ, choices = info["type"], info.get("choices")
        lay = W.Layout(width="330px")
        if choices:
            opts = list(choices)
            if info.get("optional"):
                opts = [("(none)", None)] + [(str(c), c) for c in opts]
            self.input = W.Dropdown(options=opts, value=value, description=name, style=_DESC,
                                    layout=lay)
        elif typ is bool:
            self.input = W.Checkbox(value=bool(value), description=name, style=_DESC, layout=lay)
        else:
            hint = "empty: " + _EMPTY.get(name, "none") if info.get("optional") else ""
            self.input = W.Text(value=self._to_text(value), description=name, placeholder=hint,
                                style=_DESC, layout=lay, continuous_update=True)
        rng = ""
        if info.get("lo") is not None or info.get("hi") is not None:
            rng = f" [{_num(info.get('lo'))} … {_num(info.get('hi'))}]"
        self.help = W.HTML(f"<span style='color:#666;font-size:12px'>{html.escape(info['help'])}"
                           f"{html.escape(rng)}</span>", layout=W.Layout(width="auto", flex="1"))
        self.error = W.HTML("", layout=W.Layout(display="none", margin="0 0 0 155px"))
        self.row = W.VBox([W.HBox([self.input, self.help], layout=W.Layout(align_items="center")),
                           self.error])

    @staticmethod
    def _to_text(v: Any) -> str:
        return "" if v is None else str(v)

    def get(self) -> Any:
        """The value to hand to TrainConfig (strings parsed to numbers where they can be)."""
        v = self.input.value
        if not isinstance(self.input, W.Text):
            return v
        s = v.strip()
        typ = self.info["type"]
        if s == "":
            return None if (self.info.get("optional") or typ is not str) else ""
        if typ is int:
            for conv in (int, float):
                try:
                    return conv(s)
                except ValueError:
                    continue
            return s  # TrainConfig names the field and says an int is expected
        if typ is float:
            try:
                return float(s)
            except ValueError:
                return s
        return s

    def set(self, value: Any) -> None:
        self.input.value = value if not isinstance(self.input, W.Text) else self._to_text(value)

    def __repr__(self) -> str:
        return f"Field({self.name!r}, value={self.input.value!r})"

    def show_error(self, message: str | None) -> None:
        self.error.value = (f"<span style='color:#b00;font-size:12px'>{html.escape(message)}</span>"
                            if message else "")
        self.error.layout.display = None if message else "none"


def _config_error(values: dict[str, Any]) -> str | None:
    """TrainConfig's own message for these values, or None if it accepts them."""
    try:
        TrainConfig(**values)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _num(v: Any) -> str:
    if v is None:
        return "∞"
    return f"{v:g}" if isinstance(v, float) else str(v)


class LaunchPanel(W.VBox):
    """Configure, launch, stop and checkpoint a training run from a form.

    train_fn: the training function, called as train_fn(config) on every rank (default:
    gpu_lab.train.train_classifier). config: initial form values. launcher: what Launch calls
    (default gpu_lab.launch; tests may pass another).
    script, script_args: your own script instead ("train.py" or "-m pkg.train", and its command
    line as a terminal takes it): Launch runs it on every rank, unchanged, with the form's
    num_processes, gpus, priority and mixed_precision; the script reads the rest from its
    arguments. The "what to run" toggle switches between the two.
    """

    def __init__(self, train_fn: Callable | None = None, config: TrainConfig | None = None, *,
                 launcher: Callable | None = None, dashboard_kw: dict | None = None,
                 script: str | None = None, script_args: str = "") -> None:
        if config is not None and not isinstance(config, TrainConfig):
            raise TypeError(f"LaunchPanel config: expected a TrainConfig or None, got "
                            f"{type(config).__name__}")
        if train_fn is not None and not callable(train_fn):
            raise TypeError(f"LaunchPanel train_fn: expected a callable, got {type(train_fn).__name__}")
        # Importing plotly's FigureWidget takes seconds the first time (it pulls in nbformat and
        # jsonschema): pay it now, not between the click on Launch and the first plot.
        from plotly.graph_objs import FigureWidget  # noqa: F401

        self.train_fn = train_fn
        self._launcher = launcher
        self._dashboard_kw = dict(dashboard_kw or {})
        self.run: Any = None
        self.dashboard: Dashboard | None = None
        self.errors: dict[str, str] = {}
        initial = (config or TrainConfig()).to_dict()

        help_ = TrainConfig.field_help()
        self.fields: dict[str, Field] = {}
        for name, info in help_.items():
            if info.get("form", True) is False:
                continue
            self.fields[name] = Field(name, info, initial.get(name, info["default"]))
        sections, seen = [], set()
        for title, names in SECTIONS:
            rows = [self.fields[n].row for n in names if n in self.fields]
            seen.update(names)
            if rows:
                sections.append((title, rows))
        rest = [f.row for n, f in self.fields.items() if n not in seen]
        if rest:
            sections.append(("other", rest))
        self.form = W.Accordion(children=[W.VBox(rows) for _, rows in sections],
                                titles=[t for t, _ in sections], selected_index=0)
        for f in self.fields.values():
            f.input.observe(self._on_change, names="value")

        self.launch_button = W.Button(description="Launch", button_style="success", icon="play",
                                      tooltip="start training with this configuration")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True, tooltip="SIGTERM the run (it checkpoints and "
                                    "exits), SIGKILL what is left after a grace period")
        self.checkpoint_button = W.Button(description="Checkpoint now", icon="save", disabled=True,
                                          tooltip="ask rank 0 to save at the next step boundary")
        self.launch_button.on_click(self._on_launch)
        self.stop_button.on_click(self._on_stop)
        self.checkpoint_button.on_click(self._on_checkpoint)
        self.detach = W.Checkbox(value=False, description="keep running when this kernel stops "
                                 "(detach)", indent=False, layout=W.Layout(width="auto"))
        self.resume_choice = W.Dropdown(options=[("(none)", None)], value=None,
                                        description="resume run", style=_DESC,
                                        layout=W.Layout(width="520px"))
        self.resume_choice.observe(self._on_resume_choice, names="value")
        self.resume_button = W.Button(description="Resume", icon="repeat", disabled=True,
                                      tooltip="launch a new run that continues the chosen run "
                                      "from its newest checkpoint, with the form's config")
        self.resume_button.on_click(self._on_resume)
        self.refresh_button = W.Button(icon="refresh", tooltip="list the runs again",
                                       layout=W.Layout(width="36px"))
        self.refresh_button.on_click(lambda _b: self.refresh_resumable())
        self._script_widgets(script, script_args)
        self.status = W.HTML("")
        self.form_error = W.HTML("", layout=W.Layout(display="none"))
        self.run_box = W.VBox([])
        buttons = W.HBox([self.launch_button, self.stop_button, self.checkpoint_button,
                          self.detach, self.status], layout=W.Layout(align_items="center",
                                                                     flex_flow="row wrap"))
        self.resume_row = W.HBox([self.resume_choice, self.refresh_button, self.resume_button],
                                 layout=W.Layout(align_items="center"))
        super().__init__([W.HTML("<b>gpu_lab</b> · launch a training run"), self.what,
                          self.script_box, self.form, self.form_error, buttons, self.resume_row,
                          self.run_box])
        self.refresh_resumable()
        self.validate()

    def _script_widgets(self, script: str | None, script_args: str) -> None:
        """The "what to run" toggle, and the script's path and arguments."""
        self.what = W.ToggleButtons(options=[("a training function", "function"),
                                             ("a script", "script")],
                                    value="script" if script else "function",
                                    description="what to run", style=_DESC)
        self.script_path = W.Text(value=script or "", description="script", style=_DESC,
                                  placeholder="train.py, or -m pkg.train",
                                  layout=W.Layout(width="520px"), continuous_update=True)
        self.script_args = W.Text(value=script_args, description="arguments", style=_DESC,
                                  placeholder="--lr 0.1 --epochs 3 (as a terminal takes them)",
                                  layout=W.Layout(width="520px"), continuous_update=True)
        self.script_error = W.HTML("")
        self.script_box = W.VBox([
            self.script_path, self.script_args, self.script_error,
            W.HTML("<span style='color:#666;font-size:12px'>The script runs unchanged on every "
                   "rank, as <code>accelerate launch</code> would run it; of the form below, "
                   "num_processes, gpus, priority and mixed_precision apply.</span>")])
        for w in (self.what, self.script_path, self.script_args):
            w.observe(self._on_change, names="value")

    # --- the form ----------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {n: f.get() for n, f in self.fields.items()}

    def validate(self) -> dict[str, str]:
        """Check the form; show each refused field's message inline. Returns {field: message}
        ("" for a problem that names no field)."""
        values = self.values()
        defaults = {n: f.info["default"] for n, f in self.fields.items()}
        errors: dict[str, str] = {}
        # 1. each changed field on its own (others at their defaults): its own type/range errors
        for n, v in values.items():
            if v == defaults[n] and type(v) is type(defaults[n]):
                continue
            msg = _config_error({n: v})
            if msg and n in _FIELD_RE.findall(msg):
                errors[n] = msg
        # 2. everything together, refused fields put back to their defaults: what is left is a
        #    problem between fields (epochs and max_steps both empty, say)
        msg = _config_error({n: (defaults[n] if n in errors else v) for n, v in values.items()})
        if msg:
            for n in [n for n in _FIELD_RE.findall(msg) if n in values] or [""]:
                errors.setdefault(n, msg)
        if self.what.value == "script":
            problem = self._script_problem()
            if problem:
                errors["script"] = problem
            self.script_error.value = (f"<span style='color:#b00;font-size:12px'>"
                                       f"{html.escape(problem)}</span>" if problem else "")
        self.script_box.layout.display = None if self.what.value == "script" else "none"
        self.resume_row.layout.display = "none" if self.what.value == "script" else None
        for n, f in self.fields.items():
            f.show_error(errors.get(n))
        general = errors.get("")
        self.form_error.value = (f"<span style='color:#b00'>{html.escape(general)}</span>"
                                 if general else "")
        self.form_error.layout.display = None if general else "none"
        self.errors = errors
        self._sync_buttons()
        return errors

    def _on_change(self, _change: dict) -> None:
        self.validate()

    def script_target(self) -> tuple[Any, tuple]:
        """(the Script, ()) the script fields name: found and compiled, never run here."""
        import shlex

        from ..rank.script import Script

        args = tuple(shlex.split(self.script_args.value))
        path = self.script_path.value.strip()
        if not path:
            raise ValueError("name the script to run: a path to a .py file, or -m pkg.module")
        return Script.parse(path, args, where="script"), ()

    def _script_problem(self) -> str | None:
        try:
            self.script_target()
        except ValueError as e:  # ScriptError, or shlex's unbalanced quote
            return str(e)
        return None

    @property
    def config(self) -> TrainConfig:
        """The form's TrainConfig (raises TrainConfig's error if a field is refused)."""
        return TrainConfig(**self.values())

    def set_config(self, config: TrainConfig) -> None:
        for n, v in config.to_dict().items():
            if n in self.fields:
                self.fields[n].set(v)
        self.validate()

    # --- buttons -----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.run is not None and getattr(self.run, "status", None) not in FINAL_STATUSES

    def _sync_buttons(self) -> None:
        active = self.active
        self.launch_button.disabled = active or bool(self.errors)
        self.stop_button.disabled = not active
        self.checkpoint_button.disabled = not active
        if hasattr(self, "resume_button"):
            self.resume_button.disabled = (active or bool(self.errors) or self.what.value == "script"
                                           or self.resume_choice.value is None)

    def _say(self, text: str, color: str = "#555") -> None:
        self.status.value = f"<span style='color:{color}'>{html.escape(text)}</span>"

    def _on_launch(self, _button: Any = None, resume: str | None = None) -> None:
        if self.active:
            self._say("a run is already active: stop it first", "#9a6700")
            return
        if self.validate():
            self._say("fix the fields marked in red", "#b00")
            return
        config = self.config
        try:
            launch = self._launcher or _default_launcher()
            self.launch_button.disabled = True
            self._say("launching…")
            kw = {"resume": resume} if resume is not None else {}
            if self.what.value == "script":  # the form's device settings; the rest is its argv
                script, _ = self.script_target()
                run = launch(script, num_processes=config.num_processes, gpus=config.gpus,
                             priority=config.priority, mixed_precision=config.mixed_precision,
                             detach=self.detach.value)
            else:
                fn = self.train_fn or _default_train_fn()
                run = launch(fn, config, detach=self.detach.value, **kw)
        except Exception as e:  # noqa: BLE001 - PreflightError, a refused resume: show it
            self.run = None
            self._sync_buttons()
            self._say(f"launch failed: {type(e).__name__}: {e}", "#b00")
            return
        self._show_run(run)

    def _show_run(self, run: Any) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
        self.run = run
        self.dashboard = Dashboard(run, **self._dashboard_kw)
        self.dashboard.info.on_final(self._on_run_end)
        self.run_box.children = (self.dashboard,)
        self.form.selected_index = None  # fold the form away: the run's dashboard needs the room
        self._sync_buttons()
        self._say(f"launched {getattr(run, 'id', run)}", "#1a7f37")

    # --- resume ------------------------------------------------------------------------------------
    def refresh_resumable(self) -> None:
        """List the stopped and failed runs of the registry that have a checkpoint folder."""
        from ..record.registry import Registry

        rows = [r for r in Registry().list_runs(status=("stopped", "failed"), limit=50,
                                                with_last=True) if r.get("output_dir")]
        current = self.resume_choice.value
        options = [("(none)", None)] + [
            (f"{r['name']} · {r['id']} · {r['status']} at step {r.get('last_step')}", r["id"])
            for r in rows]
        self.resume_choice.options = options
        self.resume_choice.value = current if current in {v for _, v in options} else None

    def _on_resume_choice(self, change: dict) -> None:
        run_id = change["new"]
        if run_id is not None:
            from ..record.registry import Registry

            row = Registry().get_run(run_id)
            try:
                self.set_config(TrainConfig.from_dict(row.get("config") or {}))
            except (TypeError, ValueError) as e:
                self._say(f"that run's config does not load here: {e}", "#9a6700")
        self._sync_buttons()

    def _on_resume(self, _button: Any = None) -> None:
        run_id = self.resume_choice.value
        if run_id is not None:
            self._on_launch(resume=run_id)

    def _on_run_end(self, run: Any) -> None:
        """Receiver thread, once the run's final state is drawn: re-enable Launch."""
        if run is self.run:
            self.refresh_resumable()
            self._sync_buttons()
            self._say(f"run {getattr(run, 'id', '')} {getattr(run, 'status', '')}",
                      "#b00" if getattr(run, "status", "") == "failed" else "#555")

    def _on_stop(self, _button: Any = None) -> None:
        run = self.run
        if run is None or not self.active:
            return
        self.stop_button.disabled = True
        self.checkpoint_button.disabled = True
        self._say("stopping… (the run checkpoints, then exits)", "#9a6700")
        # Run.stop waits for the process tree (up to its grace period): not on the kernel's thread
        threading.Thread(target=run.stop, name="gpu_lab-stop", daemon=True).start()

    def _on_checkpoint(self, _button: Any = None) -> None:
        run = self.run
        if run is None or not self.active:
            return
        run.request_checkpoint()
        self._say("checkpoint requested: rank 0 saves at the next step boundary")

    def close(self) -> None:
        if getattr(self, "dashboard", None) is not None:
            self.dashboard.close()
        super().close()

    def __repr__(self) -> str:
        return (f"LaunchPanel(what={self.what.value!r}, fields={len(self.fields)}, "
                f"run={getattr(self.run, 'id', None)!r}, errors={sorted(self.errors)})")


def _default_train_fn() -> Callable:
    try:
        from ..train import train_classifier
    except ImportError as e:
        raise RuntimeError("LaunchPanel: gpu_lab.train.train_classifier is not available "
                           f"({e}); pass train_fn=your_function") from e
    return train_classifier


def _default_launcher() -> Callable:
    from ..launch import launch

    return launch
